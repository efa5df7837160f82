/*
 * ep.c: the RDM endpoint.
 *
 * fi_endpoint opens the transport endpoint (mr_ep_open) right away, so that
 * fi_getname works before fi_enable; its local address is, in order:
 *   1. addr= in the environment variable MR_CONFIG (the transport reads
 *      MR_CONFIG itself; the provider then passes no addr),
 *   2. the fi_info's src_addr (from hints, or from fi_getinfo's node/service
 *      with FI_SOURCE),
 *   3. the IPv4 address of FI_METAROCE_IFACE, else of the first non-loopback
 *      interface that is up.
 * The port of a src_addr is not used: the transport picks its ports (set a
 * range with MR_CONFIG ports=LO-HI).
 *
 * Binding: one AV; CQs with FI_TRANSMIT and/or FI_RECV, optionally
 * FI_SELECTIVE_COMPLETION; an EQ is accepted and unused; counters are not
 * supported. fi_enable hooks the endpoint into its CQs.
 */
#include <arpa/inet.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>

#include "mrfi.h"

/* ---- completions from the transport ---- */

static bool is_bounce(const struct mrfi_ep *ep, const void *ctx)
{
	const struct mrfi_bounce *b = ctx;
	return ep->bounce && b >= ep->bounce && b < ep->bounce + MRFI_BOUNCE_SLOTS;
}

void mrfi_ep_bounce_put(struct mrfi_ep *ep, struct mrfi_bounce *b)
{
	free(b->copy);
	b->copy = NULL;
	pthread_mutex_lock(&ep->bounce_lock);
	b->next_free = ep->bounce_free;
	ep->bounce_free = (int)(b - ep->bounce);
	pthread_mutex_unlock(&ep->bounce_lock);
}

struct mrfi_bounce *mrfi_ep_bounce_get(struct mrfi_ep *ep)
{
	struct mrfi_bounce *b = NULL;
	pthread_mutex_lock(&ep->bounce_lock);
	if (!ep->bounce) {
		ep->bounce = calloc(MRFI_BOUNCE_SLOTS, sizeof(*ep->bounce));
		if (ep->bounce) {
			for (int i = 0; i < MRFI_BOUNCE_SLOTS; i++)
				ep->bounce[i].next_free = i + 1 < MRFI_BOUNCE_SLOTS ? i + 1 : -1;
			ep->bounce_free = 0;
		}
	}
	if (ep->bounce && ep->bounce_free >= 0) {
		b = &ep->bounce[ep->bounce_free];
		ep->bounce_free = b->next_free;
	}
	pthread_mutex_unlock(&ep->bounce_lock);
	return b;
}

static void route(struct mrfi_ep *ep, const struct mr_completion *c,
		  const struct mrfi_cq *poller)
{
	bool send = c->flags & MR_SEND;
	struct mrfi_cq *cq = send ? ep->tx_cq : ep->rx_cq;
	struct mrfi_cqe e = {0};
	void *ctx = c->context;

	if (send && is_bounce(ep, ctx)) {
		struct mrfi_bounce *b = ctx;
		ctx = b->user_context;
		mrfi_ep_bounce_put(ep, b);
	}
	if (!cq)
		return;
	e.op_context = ctx;
	e.flags = (send ? FI_SEND : FI_RECV) |
		  ((c->flags & MR_TAGGED) ? FI_TAGGED : FI_MSG);
	if (c->flags & MR_REMOTE_CQ_DATA) {
		e.flags |= FI_REMOTE_CQ_DATA;
		e.data = c->data;
	}
	e.len = (size_t)c->len;
	if (!send) {
		e.buf = c->buf;
		e.tag = (c->flags & MR_TAGGED) ? c->tag : 0;
		e.src = c->err ? FI_ADDR_NOTAVAIL : mrfi_av_src(ep, c->peer);
	} else {
		e.src = FI_ADDR_NOTAVAIL;
	}
	if (c->err) {
		e.err = -mrfi_err(c->err);
		e.prov_errno = -c->err;
		e.olen = (size_t)c->olen;
	}
	mrfi_cq_push(cq, &e, poller);
}

int mrfi_ep_progress(struct mrfi_ep *ep, const struct mrfi_cq *poller)
{
	struct mr_completion c[MRFI_POLL_BATCH];
	int n, rc = 0;

	/* The transport's eventfd is readable exactly while completions are
	 * pending. When it is not, the reader receives and acknowledges itself
	 * (mr_progress: skipped while the progress thread holds the endpoint),
	 * so a spinning rank needs no wake-up of that thread, which waits for
	 * the spinner's time slice on a busy core. A failed endpoint makes
	 * mr_progress fail, and mr_poll below reports it. */
	if (ep->fd >= 0) {
		struct pollfd p = {.fd = ep->fd, .events = POLLIN};
		if (poll(&p, 1, 0) == 0 && mr_progress(ep->mr) == 0)
			return 0;
	}
	pthread_mutex_lock(&ep->poll_lock);
	do {
		n = mr_poll(ep->mr, c, MRFI_POLL_BATCH);
		if (n < 0) {
			rc = mrfi_err(n);
			FI_WARN_ONCE(&mrfi_prov, FI_LOG_EP_DATA,
				     "endpoint %s failed: %s\n", ep->local_name,
				     fi_strerror(-rc));
			break;
		}
		for (int i = 0; i < n; i++)
			route(ep, &c[i], poller);
	} while (n == MRFI_POLL_BATCH);
	pthread_mutex_unlock(&ep->poll_lock);
	return rc;
}

void mrfi_ep_push_rx(struct mrfi_ep *ep, const struct mrfi_cqe *e)
{
	if (ep->rx_cq)
		mrfi_cq_push(ep->rx_cq, e, NULL);
}

/* ---- fi_ops_ep ---- */

static ssize_t ep_cancel(fid_t fid, void *context)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	if (!ep->enabled)
		return -FI_EOPBADSTATE;
	/* 0: a FI_ECANCELED completion follows; -FI_ENOENT: already matched
	 * or never posted. */
	return mrfi_err(mr_cancel(ep->mr, context));
}

static int ep_getopt(fid_t fid, int level, int optname, void *optval,
		     size_t *optlen)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	if (level != FI_OPT_ENDPOINT)
		return -FI_ENOPROTOOPT;
	switch (optname) {
	case FI_OPT_MIN_MULTI_RECV:
		if (*optlen < sizeof(size_t))
			return -FI_ETOOSMALL;
		*(size_t *)optval = ep->min_multi_recv;
		*optlen = sizeof(size_t);
		return 0;
	case FI_OPT_CM_DATA_SIZE:
		if (*optlen < sizeof(size_t))
			return -FI_ETOOSMALL;
		*(size_t *)optval = 0;
		*optlen = sizeof(size_t);
		return 0;
	default:
		return -FI_ENOPROTOOPT;
	}
}

static int ep_setopt(fid_t fid, int level, int optname, const void *optval,
		     size_t optlen)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	if (level != FI_OPT_ENDPOINT)
		return -FI_ENOPROTOOPT;
	switch (optname) {
	case FI_OPT_MIN_MULTI_RECV:
		/* Tolerated: there is no FI_MULTI_RECV to apply it to. */
		if (optlen != sizeof(size_t))
			return -FI_EINVAL;
		ep->min_multi_recv = *(const size_t *)optval;
		return 0;
	default:
		return -FI_ENOPROTOOPT;
	}
}

static int no_ctx(struct fid_ep *sep, int index, void *attr,
		  struct fid_ep **out, void *context)
{
	(void)sep;
	(void)index;
	(void)attr;
	(void)out;
	(void)context;
	return -FI_ENOSYS;
}

static int no_tx_ctx(struct fid_ep *sep, int index, struct fi_tx_attr *attr,
		     struct fid_ep **tx_ep, void *context)
{
	return no_ctx(sep, index, attr, tx_ep, context);
}

static int no_rx_ctx(struct fid_ep *sep, int index, struct fi_rx_attr *attr,
		     struct fid_ep **rx_ep, void *context)
{
	return no_ctx(sep, index, attr, rx_ep, context);
}

static ssize_t ep_rx_size_left(struct fid_ep *ep)
{
	(void)ep;
	return MRFI_RX_SIZE;
}

static ssize_t ep_tx_size_left(struct fid_ep *ep)
{
	(void)ep;
	return MRFI_TX_SIZE;
}

static struct fi_ops_ep ep_ops = {
	.size = sizeof(struct fi_ops_ep),
	.cancel = ep_cancel,
	.getopt = ep_getopt,
	.setopt = ep_setopt,
	.tx_ctx = no_tx_ctx,
	.rx_ctx = no_rx_ctx,
	.rx_size_left = ep_rx_size_left,
	.tx_size_left = ep_tx_size_left,
};

/* ---- fi_ops_cm ---- */

static int ep_getname(fid_t fid, void *addr, size_t *addrlen)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	uint8_t name[MR_ADDR_LEN];
	size_t len = sizeof(name);
	size_t room = *addrlen;
	int rc = mr_ep_name(ep->mr, name, &len);

	if (rc) {
		mrfi_log_last_error(FI_LOG_EP_CTRL, "mr_ep_name", rc);
		return mrfi_err(rc);
	}
	*addrlen = MR_ADDR_LEN;
	if (room < MR_ADDR_LEN) {
		if (addr && room)
			memcpy(addr, name, room);
		return -FI_ETOOSMALL;
	}
	memcpy(addr, name, MR_ADDR_LEN);
	return 0;
}

static int no_setname(fid_t fid, void *addr, size_t addrlen)
{
	(void)fid;
	(void)addr;
	(void)addrlen;
	return -FI_ENOSYS; /* the address is fixed when the endpoint opens */
}

static int no_getpeer(struct fid_ep *ep, void *addr, size_t *addrlen)
{
	(void)ep;
	(void)addr;
	(void)addrlen;
	return -FI_ENOSYS;
}

static int no_connect(struct fid_ep *ep, const void *addr, const void *param,
		      size_t paramlen)
{
	(void)ep;
	(void)addr;
	(void)param;
	(void)paramlen;
	return -FI_ENOSYS;
}

static int no_listen(struct fid_pep *pep)
{
	(void)pep;
	return -FI_ENOSYS;
}

static int no_accept(struct fid_ep *ep, const void *param, size_t paramlen)
{
	(void)ep;
	(void)param;
	(void)paramlen;
	return -FI_ENOSYS;
}

static int no_reject(struct fid_pep *pep, fid_t handle, const void *param,
		     size_t paramlen)
{
	(void)pep;
	(void)handle;
	(void)param;
	(void)paramlen;
	return -FI_ENOSYS;
}

static int no_shutdown(struct fid_ep *ep, uint64_t flags)
{
	(void)ep;
	(void)flags;
	return -FI_ENOSYS;
}

static int no_join(struct fid_ep *ep, const void *addr, uint64_t flags,
		   struct fid_mc **mc, void *context)
{
	(void)ep;
	(void)addr;
	(void)flags;
	(void)mc;
	(void)context;
	return -FI_ENOSYS;
}

struct fi_ops_cm mrfi_cm_ops = {
	.size = sizeof(struct fi_ops_cm),
	.setname = no_setname,
	.getname = ep_getname,
	.getpeer = no_getpeer,
	.connect = no_connect,
	.listen = no_listen,
	.accept = no_accept,
	.reject = no_reject,
	.shutdown = no_shutdown,
	.join = no_join,
};

/* ---- fi_ops (fid) ---- */

static int ep_close(struct fid *fid)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	struct mrfi_cq *cqs[2] = {ep->tx_cq, ep->rx_cq};
	int rc;

	if (ep->enabled) {
		mrfi_cq_remove_ep(ep->tx_cq ? ep->tx_cq : ep->rx_cq, ep);
		if (ep->rx_cq && ep->rx_cq != ep->tx_cq)
			mrfi_cq_remove_ep(ep->rx_cq, ep);
	}
	for (int i = 0; i < 2; i++) {
		if (!cqs[i])
			continue;
		pthread_mutex_lock(&cqs[i]->eps_lock);
		cqs[i]->refs--;
		pthread_mutex_unlock(&cqs[i]->eps_lock);
	}
	if (ep->av)
		mrfi_av_unbind_ep(ep->av, ep);
	/* Lingers until sent data is acknowledged (bounded by the transport). */
	rc = mr_ep_close(ep->mr);
	if (rc)
		mrfi_log_last_error(FI_LOG_EP_CTRL, "mr_ep_close", rc);
	if (ep->bounce) {
		for (int i = 0; i < MRFI_BOUNCE_SLOTS; i++)
			free(ep->bounce[i].copy);
		free(ep->bounce);
	}
	pthread_mutex_destroy(&ep->poll_lock);
	pthread_mutex_destroy(&ep->bounce_lock);
	mrfi_domain_ref(ep->domain, -1);
	free(ep);
	return 0;
}

static int ep_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;

	if (ep->enabled)
		return -FI_EOPBADSTATE;
	switch (bfid->fclass) {
	case FI_CLASS_AV: {
		struct mrfi_av *av = (struct mrfi_av *)bfid;
		if (ep->av)
			return -FI_EINVAL;
		if (av->domain != ep->domain)
			return -FI_EDOMAIN;
		int rc = mrfi_av_bind_ep(av, ep);
		if (!rc)
			ep->av = av;
		return rc;
	}
	case FI_CLASS_CQ: {
		struct mrfi_cq *cq = (struct mrfi_cq *)bfid;
		if (cq->domain != ep->domain)
			return -FI_EDOMAIN;
		if (flags & ~(FI_TRANSMIT | FI_RECV | FI_SELECTIVE_COMPLETION))
			return -FI_EBADFLAGS;
		if (!(flags & (FI_TRANSMIT | FI_RECV)))
			return -FI_EBADFLAGS;
		if (((flags & FI_TRANSMIT) && ep->tx_cq) ||
		    ((flags & FI_RECV) && ep->rx_cq))
			return -FI_EINVAL;
		pthread_mutex_lock(&cq->eps_lock);
		if (flags & FI_TRANSMIT) {
			ep->tx_cq = cq;
			ep->tx_selective = flags & FI_SELECTIVE_COMPLETION;
			cq->refs++;
		}
		if (flags & FI_RECV) {
			ep->rx_cq = cq;
			ep->rx_selective = flags & FI_SELECTIVE_COMPLETION;
			cq->refs++;
		}
		pthread_mutex_unlock(&cq->eps_lock);
		return 0;
	}
	case FI_CLASS_EQ:
		return 0; /* no events to report on an RDM endpoint */
	case FI_CLASS_CNTR:
		MRFI_WARN(FI_LOG_EP_CTRL, "counters are not supported\n");
		return -FI_ENOSYS;
	default:
		return -FI_EINVAL;
	}
}

static int ep_enable(struct mrfi_ep *ep)
{
	int rc;
	if (ep->enabled)
		return 0;
	if (!ep->av) {
		MRFI_WARN(FI_LOG_EP_CTRL, "fi_enable: bind an AV first\n");
		return -FI_ENOAV;
	}
	if (!ep->tx_cq && !ep->rx_cq) {
		MRFI_WARN(FI_LOG_EP_CTRL, "fi_enable: bind a CQ first\n");
		return -FI_ENOCQ;
	}
	if (ep->tx_cq && (rc = mrfi_cq_add_ep(ep->tx_cq, ep)))
		return rc;
	if (ep->rx_cq && ep->rx_cq != ep->tx_cq &&
	    (rc = mrfi_cq_add_ep(ep->rx_cq, ep))) {
		if (ep->tx_cq)
			mrfi_cq_remove_ep(ep->tx_cq, ep);
		return rc;
	}
	ep->enabled = true;
	return 0;
}

static int ep_control(struct fid *fid, int command, void *arg)
{
	struct mrfi_ep *ep = (struct mrfi_ep *)fid;
	uint64_t *flags = arg;

	switch (command) {
	case FI_ENABLE:
		return ep_enable(ep);
	case FI_GETOPSFLAG:
		if ((*flags & FI_TRANSMIT) && (*flags & FI_RECV))
			return -FI_EINVAL;
		if (*flags & FI_TRANSMIT)
			*flags = ep->tx_op_flags;
		else if (*flags & FI_RECV)
			*flags = ep->rx_op_flags;
		else
			return -FI_EINVAL;
		return 0;
	case FI_SETOPSFLAG:
		if (*flags & FI_TRANSMIT)
			ep->tx_op_flags = *flags & ~(FI_TRANSMIT | FI_RECV);
		else if (*flags & FI_RECV)
			ep->rx_op_flags = *flags & ~(FI_TRANSMIT | FI_RECV);
		else
			return -FI_EINVAL;
		return 0;
	default:
		return -FI_ENOSYS;
	}
}

static struct fi_ops ep_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = ep_close,
	.bind = ep_bind,
	.control = ep_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

/* The IP part of "udp://IP:PORT" or "udp://[IP6]:PORT". */
static bool ip_of(const char *str, char *ip, size_t len)
{
	const char *p = strstr(str, "://");
	const char *end;
	p = p ? p + 3 : str;
	if (*p == '[') {
		p++;
		end = strchr(p, ']');
	} else {
		end = strrchr(p, ':');
	}
	if (!end || (size_t)(end - p) >= len)
		return false;
	memcpy(ip, p, (size_t)(end - p));
	ip[end - p] = '\0';
	return true;
}

/* The IP of a name whose port is 0 (what fi_getinfo(node, NULL, FI_SOURCE)
 * makes), which mr_addr_format refuses. Layout (crates/metaroce/src/addr.rs,
 * version 1): version, family 4|6, port (BE), 16 address bytes, 4 zero. */
static bool name_ip(const uint8_t *n, char *ip, size_t len)
{
	if (n[0] != 1 || (n[1] != 4 && n[1] != 6))
		return false;
	return inet_ntop(n[1] == 4 ? AF_INET : AF_INET6, n + 4, ip,
			 (socklen_t)len) != NULL;
}

static int ep_config(const struct fi_info *info, char *cfg, size_t len)
{
	char ip[64], str[128];

	cfg[0] = '\0';
	if (mrfi_config_addr(ip, sizeof(ip)))
		return 0; /* MR_CONFIG names the address; the transport reads it */
	if (info->src_addr) {
		int rc = mr_addr_format(info->src_addr, MR_ADDR_LEN, str, sizeof(str));
		if (rc && name_ip(info->src_addr, ip, sizeof(ip)))
			rc = 0; /* port 0: mr_addr_format refuses it */
		else if (!rc && !ip_of(str, ip, sizeof(ip)))
			rc = -FI_EINVAL;
		if (rc) {
			MRFI_WARN(FI_LOG_EP_CTRL, "src_addr is not a metaroce "
				  "address\n");
			return -FI_EINVAL;
		}
	} else {
		int rc = mrfi_local_ip(ip, sizeof(ip));
		if (rc)
			return rc;
	}
	snprintf(cfg, len, "addr=%s", ip);
	return 0;
}

int mrfi_ep_open(struct fid_domain *domain, struct fi_info *info,
		 struct fid_ep **out, void *context)
{
	struct mrfi_domain *d = (struct mrfi_domain *)domain;
	struct mrfi_ep *ep;
	char cfg[256], str[128];
	uint8_t name[MR_ADDR_LEN];
	size_t len = sizeof(name);
	int rc;

	if (!info || (info->ep_attr && info->ep_attr->type != FI_EP_RDM &&
		      info->ep_attr->type != FI_EP_UNSPEC)) {
		MRFI_WARN(FI_LOG_EP_CTRL, "only FI_EP_RDM endpoints\n");
		return -FI_EINVAL;
	}
	if (info->caps & ~MRFI_CAPS) {
		MRFI_WARN(FI_LOG_EP_CTRL, "caps %#llx not supported\n",
			  (unsigned long long)(info->caps & ~MRFI_CAPS));
		return -FI_EINVAL;
	}
	if (info->src_addr && info->src_addrlen != MR_ADDR_LEN)
		return -FI_EINVAL;
	rc = ep_config(info, cfg, sizeof(cfg));
	if (rc)
		return rc;

	ep = calloc(1, sizeof(*ep));
	if (!ep)
		return -FI_ENOMEM;
	rc = mr_ep_open(cfg[0] ? cfg : NULL, &ep->mr);
	if (rc) {
		mrfi_log_last_error(FI_LOG_EP_CTRL, "mr_ep_open", rc);
		free(ep);
		return mrfi_err(rc);
	}
	ep->fd = mr_ep_fd(ep->mr);
	if (ep->fd < 0)
		ep->fd = -1;
	ep->domain = d;
	ep->caps = info->caps ? info->caps : MRFI_CAPS;
	ep->tx_op_flags = info->tx_attr ? info->tx_attr->op_flags : 0;
	ep->rx_op_flags = info->rx_attr ? info->rx_attr->op_flags : 0;
	ep->max_inject = mr_max_inject();
	ep->bounce_free = -1;
	pthread_mutex_init(&ep->poll_lock, NULL);
	pthread_mutex_init(&ep->bounce_lock, NULL);
	if (mr_ep_name(ep->mr, name, &len) == 0 &&
	    mr_addr_format(name, len, str, sizeof(str)) == 0)
		snprintf(ep->local_name, sizeof(ep->local_name), "%s", str);
	else
		snprintf(ep->local_name, sizeof(ep->local_name), "(unnamed)");
	MRFI_INFO(FI_LOG_EP_CTRL, "endpoint %s opened (config \"%s\")\n",
		  ep->local_name, cfg);

	ep->ep_fid.fid.fclass = FI_CLASS_EP;
	ep->ep_fid.fid.context = context;
	ep->ep_fid.fid.ops = &ep_fid_ops;
	ep->ep_fid.ops = &ep_ops;
	ep->ep_fid.cm = &mrfi_cm_ops;
	ep->ep_fid.msg = &mrfi_msg_ops;
	ep->ep_fid.rma = &mrfi_no_rma_ops;
	ep->ep_fid.tagged = &mrfi_tagged_ops;
	ep->ep_fid.atomic = &mrfi_no_atomic_ops;
	ep->ep_fid.collective = NULL;
	mrfi_domain_ref(d, 1);
	*out = &ep->ep_fid;
	return 0;
}
