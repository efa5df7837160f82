/*
 * av.c: the address vector, FI_AV_MAP and FI_AV_TABLE alike.
 *
 * The AV keeps the raw MR_ADDR_LEN-byte names; fi_addr_t is the entry's
 * index (sequential from 0, as FI_AV_TABLE requires; any value is valid for
 * FI_AV_MAP). Inserting a name already present returns its index. An AV can
 * exist before any endpoint and be bound to several, so each endpoint turns
 * an index into an mr_peer on first use (mr_av_insert) and keeps both
 * directions cached; av->lock guards the AV and those caches.
 */
#include <stdio.h>
#include <stdlib.h>

#include "mrfi.h"

static bool entry_ok(const struct mrfi_av *av, fi_addr_t a)
{
	return a < av->len && av->entries[a].valid;
}

/* Index of addr, or FI_ADDR_NOTAVAIL. Caller holds av->lock. */
static fi_addr_t av_find(const struct mrfi_av *av, const void *addr)
{
	uint64_t idx;
	if (mrfi_map_get(&av->by_addr, mrfi_hash_bytes(addr, MR_ADDR_LEN), &idx) &&
	    entry_ok(av, idx) && !memcmp(av->entries[idx].addr, addr, MR_ADDR_LEN))
		return idx;
	/* A 64-bit hash collision: fall back to a scan. */
	for (size_t i = 0; i < av->len; i++)
		if (av->entries[i].valid &&
		    !memcmp(av->entries[i].addr, addr, MR_ADDR_LEN))
			return i;
	return FI_ADDR_NOTAVAIL;
}

static int av_add(struct mrfi_av *av, const void *addr, fi_addr_t *out)
{
	char str[128];
	fi_addr_t idx;
	int rc;

	rc = mr_addr_format(addr, MR_ADDR_LEN, str, sizeof(str));
	if (rc) {
		mrfi_log_last_error(FI_LOG_AV, "fi_av_insert: not a metaroce "
				    "address", rc);
		return -FI_EINVAL;
	}
	idx = av_find(av, addr);
	if (idx != FI_ADDR_NOTAVAIL) {
		*out = idx;
		return 0;
	}
	if (av->len == av->cap) {
		size_t cap = av->cap ? av->cap * 2 : 64;
		struct mrfi_av_entry *e = realloc(av->entries, cap * sizeof(*e));
		if (!e)
			return -FI_ENOMEM;
		av->entries = e;
		av->cap = cap;
	}
	idx = av->len;
	memcpy(av->entries[idx].addr, addr, MR_ADDR_LEN);
	av->entries[idx].valid = true;
	rc = mrfi_map_put(&av->by_addr, mrfi_hash_bytes(addr, MR_ADDR_LEN), idx);
	if (rc)
		return rc;
	av->len++;
	*out = idx;
	return 0;
}

static int av_insert(struct fid_av *fid, const void *addr, size_t count,
		     fi_addr_t *fi_addr, uint64_t flags, void *context)
{
	struct mrfi_av *av = (struct mrfi_av *)fid;
	int *sync_err = (flags & FI_SYNC_ERR) ? context : NULL;
	int n = 0;

	if (flags & ~(FI_MORE | FI_SYNC_ERR)) {
		MRFI_WARN(FI_LOG_AV, "fi_av_insert flags %#llx not supported\n",
			  (unsigned long long)flags);
		return -FI_EBADFLAGS;
	}
	pthread_mutex_lock(&av->lock);
	for (size_t i = 0; i < count; i++) {
		fi_addr_t idx = FI_ADDR_NOTAVAIL;
		int rc = av_add(av, (const uint8_t *)addr + i * MR_ADDR_LEN, &idx);
		if (fi_addr)
			fi_addr[i] = rc ? FI_ADDR_NOTAVAIL : idx;
		if (sync_err)
			sync_err[i] = -rc;
		if (!rc)
			n++;
	}
	pthread_mutex_unlock(&av->lock);
	return n;
}

static int av_insertsvc(struct fid_av *fid, const char *node,
			const char *service, fi_addr_t *fi_addr, uint64_t flags,
			void *context)
{
	char str[300];
	uint8_t name[MR_ADDR_LEN];
	size_t len = sizeof(name);
	int rc;

	snprintf(str, sizeof(str), strchr(node, ':') ? "udp://[%s]:%s" : "udp://%s:%s",
		 node, service);
	rc = mr_addr_parse(str, name, &len);
	if (rc) {
		mrfi_log_last_error(FI_LOG_AV, str, rc);
		return -FI_EINVAL;
	}
	return av_insert(fid, name, 1, fi_addr, flags, context);
}

static int av_insertsym(struct fid_av *fid, const char *node, size_t nodecnt,
			const char *service, size_t svccnt, fi_addr_t *fi_addr,
			uint64_t flags, void *context)
{
	(void)fid;
	(void)node;
	(void)nodecnt;
	(void)service;
	(void)svccnt;
	(void)fi_addr;
	(void)flags;
	(void)context;
	return -FI_ENOSYS;
}

static int av_remove(struct fid_av *fid, fi_addr_t *fi_addr, size_t count,
		     uint64_t flags)
{
	struct mrfi_av *av = (struct mrfi_av *)fid;
	int rc = 0;

	(void)flags;
	pthread_mutex_lock(&av->lock);
	for (size_t i = 0; i < count; i++) {
		fi_addr_t a = fi_addr[i];
		if (!entry_ok(av, a)) {
			rc = -FI_EINVAL;
			continue;
		}
		av->entries[a].valid = false;
		mrfi_map_del(&av->by_addr,
			     mrfi_hash_bytes(av->entries[a].addr, MR_ADDR_LEN));
		for (size_t e = 0; e < av->neps; e++) {
			struct mrfi_ep *ep = av->eps[e];
			if (a < ep->peer_of_len && ep->peer_of[a] != MR_ANY_PEER) {
				mrfi_map_del(&ep->addr_of, ep->peer_of[a]);
				mr_av_remove(ep->mr, ep->peer_of[a]);
				ep->peer_of[a] = MR_ANY_PEER;
			}
		}
	}
	pthread_mutex_unlock(&av->lock);
	return rc;
}

static int av_lookup(struct fid_av *fid, fi_addr_t fi_addr, void *addr,
		     size_t *addrlen)
{
	struct mrfi_av *av = (struct mrfi_av *)fid;
	int rc = 0;

	pthread_mutex_lock(&av->lock);
	if (!entry_ok(av, fi_addr)) {
		rc = -FI_EINVAL;
	} else {
		size_t n = *addrlen < MR_ADDR_LEN ? *addrlen : MR_ADDR_LEN;
		memcpy(addr, av->entries[fi_addr].addr, n);
	}
	pthread_mutex_unlock(&av->lock);
	*addrlen = MR_ADDR_LEN;
	return rc;
}

static const char *av_straddr(struct fid_av *fid, const void *addr, char *buf,
			      size_t *len)
{
	char str[128];
	size_t need;
	(void)fid;

	if (mr_addr_format(addr, MR_ADDR_LEN, str, sizeof(str)))
		snprintf(str, sizeof(str), "(not a metaroce address)");
	need = strlen(str) + 1;
	if (buf && *len) {
		size_t n = need < *len ? need : *len;
		memcpy(buf, str, n);
		buf[n - 1] = '\0';
	}
	*len = need;
	return buf;
}

static int no_av_set(struct fid_av *av, struct fi_av_set_attr *attr,
		     struct fid_av_set **av_set, void *context)
{
	(void)av;
	(void)attr;
	(void)av_set;
	(void)context;
	return -FI_ENOSYS;
}

static int av_close(struct fid *fid)
{
	struct mrfi_av *av = (struct mrfi_av *)fid;

	pthread_mutex_lock(&av->lock);
	if (av->neps) {
		pthread_mutex_unlock(&av->lock);
		return -FI_EBUSY;
	}
	pthread_mutex_unlock(&av->lock);
	pthread_mutex_destroy(&av->lock);
	mrfi_map_free(&av->by_addr);
	free(av->entries);
	free(av->eps);
	mrfi_domain_ref(av->domain, -1);
	free(av);
	return 0;
}

static struct fi_ops av_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = av_close,
	.bind = mrfi_no_bind,
	.control = mrfi_no_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static struct fi_ops_av av_ops = {
	.size = sizeof(struct fi_ops_av),
	.insert = av_insert,
	.insertsvc = av_insertsvc,
	.insertsym = av_insertsym,
	.remove = av_remove,
	.lookup = av_lookup,
	.straddr = av_straddr,
	.av_set = no_av_set,
};

int mrfi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
		 struct fid_av **out, void *context)
{
	struct mrfi_domain *d = (struct mrfi_domain *)domain;
	struct mrfi_av *av;

	if (attr->name) {
		MRFI_WARN(FI_LOG_AV, "named (shared) AVs are not supported\n");
		return -FI_ENOSYS;
	}
	if (attr->flags & FI_EVENT) {
		MRFI_WARN(FI_LOG_AV, "asynchronous AVs (FI_EVENT) are not "
			  "supported; inserts complete synchronously\n");
		return -FI_ENOSYS;
	}
	if (attr->rx_ctx_bits) {
		MRFI_WARN(FI_LOG_AV, "rx_ctx_bits: no scalable endpoints\n");
		return -FI_EINVAL;
	}
	if (attr->type != FI_AV_UNSPEC && attr->type != FI_AV_MAP &&
	    attr->type != FI_AV_TABLE)
		return -FI_EINVAL;
	av = calloc(1, sizeof(*av));
	if (!av)
		return -FI_ENOMEM;
	av->domain = d;
	av->type = attr->type == FI_AV_UNSPEC ? FI_AV_TABLE : attr->type;
	pthread_mutex_init(&av->lock, NULL);
	av->av_fid.fid.fclass = FI_CLASS_AV;
	av->av_fid.fid.context = context;
	av->av_fid.fid.ops = &av_fid_ops;
	av->av_fid.ops = &av_ops;
	mrfi_domain_ref(d, 1);
	*out = &av->av_fid;
	return 0;
}

int mrfi_av_bind_ep(struct mrfi_av *av, struct mrfi_ep *ep)
{
	int rc = 0;
	pthread_mutex_lock(&av->lock);
	if (av->neps == av->cap_eps) {
		size_t cap = av->cap_eps ? av->cap_eps * 2 : 4;
		struct mrfi_ep **e = realloc(av->eps, cap * sizeof(*e));
		if (!e) {
			rc = -FI_ENOMEM;
			goto out;
		}
		av->eps = e;
		av->cap_eps = cap;
	}
	av->eps[av->neps++] = ep;
out:
	pthread_mutex_unlock(&av->lock);
	return rc;
}

void mrfi_av_unbind_ep(struct mrfi_av *av, struct mrfi_ep *ep)
{
	pthread_mutex_lock(&av->lock);
	for (size_t i = 0; i < av->neps; i++) {
		if (av->eps[i] == ep) {
			av->eps[i] = av->eps[--av->neps];
			break;
		}
	}
	free(ep->peer_of);
	ep->peer_of = NULL;
	ep->peer_of_len = 0;
	mrfi_map_free(&ep->addr_of);
	pthread_mutex_unlock(&av->lock);
}

/* Cache peer for index a in ep. Caller holds av->lock. */
static int cache_peer(struct mrfi_ep *ep, fi_addr_t a, mr_peer peer)
{
	if (a >= ep->peer_of_len) {
		size_t n = ep->peer_of_len ? ep->peer_of_len : 64;
		while (n <= a)
			n *= 2;
		mr_peer *p = realloc(ep->peer_of, n * sizeof(*p));
		if (!p)
			return -FI_ENOMEM;
		for (size_t i = ep->peer_of_len; i < n; i++)
			p[i] = MR_ANY_PEER;
		ep->peer_of = p;
		ep->peer_of_len = n;
	}
	ep->peer_of[a] = peer;
	return mrfi_map_put(&ep->addr_of, peer, a);
}

int mrfi_av_peer(struct mrfi_ep *ep, fi_addr_t a, mr_peer *peer)
{
	struct mrfi_av *av = ep->av;
	int rc = 0;

	if (!av)
		return -FI_ENOAV;
	pthread_mutex_lock(&av->lock);
	if (a < ep->peer_of_len && ep->peer_of[a] != MR_ANY_PEER) {
		*peer = ep->peer_of[a];
	} else if (!entry_ok(av, a)) {
		rc = -FI_EINVAL;
	} else {
		rc = mr_av_insert(ep->mr, av->entries[a].addr, MR_ADDR_LEN, peer);
		if (rc)
			mrfi_log_last_error(FI_LOG_AV, "mr_av_insert", rc);
		else
			rc = cache_peer(ep, a, *peer);
	}
	pthread_mutex_unlock(&av->lock);
	return rc;
}

fi_addr_t mrfi_av_src(struct mrfi_ep *ep, mr_peer peer)
{
	struct mrfi_av *av = ep->av;
	uint8_t addr[MR_ADDR_LEN];
	size_t len = sizeof(addr);
	uint64_t a;
	fi_addr_t out = FI_ADDR_NOTAVAIL;

	if (!av || peer == MR_ANY_PEER)
		return FI_ADDR_NOTAVAIL;
	pthread_mutex_lock(&av->lock);
	if (mrfi_map_get(&ep->addr_of, peer, &a)) {
		out = a;
	} else if (mr_av_lookup(ep->mr, peer, addr, &len) == 0 &&
		   len == MR_ADDR_LEN) {
		/* A sender this endpoint has not addressed yet: find its name
		 * in the AV and remember the pair. */
		out = av_find(av, addr);
		if (out != FI_ADDR_NOTAVAIL)
			cache_peer(ep, out, peer);
	}
	pthread_mutex_unlock(&av->lock);
	return out;
}
