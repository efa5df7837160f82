/*
 * prov.c: the provider entry point (fi_prov_ini) and fi_getinfo.
 *
 * fi_getinfo returns one fi_info: FI_EP_RDM over the MetaRoCE transport.
 * Hints are honoured field by field; anything the provider does not do makes
 * it answer -FI_ENODATA (libfabric then moves on to the next provider).
 * Addresses are the transport's raw MR_ADDR_LEN-byte names, reported as
 * FI_FORMAT_UNSPEC (provider-specific, opaque to the application).
 */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <strings.h>

#include "mrfi.h"

static void mrfi_cleanup(void)
{
}

struct fi_provider mrfi_prov = {
	.version = MRFI_PROV_VERSION,
	.fi_version = MRFI_FI_VERSION,
	.name = MRFI_PROV_NAME,
	.getinfo = mrfi_getinfo,
	.fabric = mrfi_fabric_open,
	.cleanup = mrfi_cleanup,
};

#ifndef MRFI_DUPINFO_ABI_MINOR
#error "MRFI_DUPINFO_ABI_MINOR: the minor of the FABRIC_1.x fi_dupinfo this build links (build.sh sets it)"
#endif

/*
 * The fi_info structures a provider returns reach the application as the
 * core's own layout, and this provider makes them with fi_dupinfo: the
 * fi_dupinfo version this object links is the layout it writes (FABRIC_1.3
 * for libfabric 1.9-1.19, 1.7 for 1.20-1.22, 1.8 for 2.x). A core whose
 * default fi_dupinfo is newer would read and free fields past what this
 * build allocated, so this build stays out of such a core; the build against
 * that core's headers (libmetaroce-v2-fi.so for 2.x) registers there. An
 * older core cannot load this object at all (the symbol version is missing).
 * Returns the newest FABRIC_1.x minor the core has above this build's, or 0.
 */
static int mrfi_core_layout_newer(void)
{
	void *core = dlopen("libfabric.so.1", RTLD_LAZY | RTLD_NOLOAD);
	int newer = 0;

	if (!core)
		return 0; /* not found by that name: nothing to compare with */
	for (int minor = MRFI_DUPINFO_ABI_MINOR + 1;
	     minor <= MRFI_DUPINFO_ABI_MINOR + 16; minor++) {
		char version[32];

		snprintf(version, sizeof(version), "FABRIC_1.%d", minor);
		if (dlvsym(core, "fi_dupinfo", version))
			newer = minor;
	}
	dlclose(core);
	return newer;
}

FI_EXT_INI
{
	int newer = mrfi_core_layout_newer();

	if (newer) {
		MRFI_WARN(FI_LOG_CORE,
			  "this build of the metaroce provider writes fi_info as "
			  "FABRIC_1.%d, libfabric %u.%u (this process's) reads "
			  "FABRIC_1.%d: not registering; the build for it is "
			  "libmetaroce-v2-fi.so (libfabric 2.x) beside this one\n",
			  MRFI_DUPINFO_ABI_MINOR, FI_MAJOR(fi_version()),
			  FI_MINOR(fi_version()), newer);
		return NULL;
	}
	fi_param_define(&mrfi_prov, "iface", FI_PARAM_STRING,
			"Network interface whose first IPv4 address the "
			"endpoints bind when neither MR_CONFIG addr= nor the "
			"fi_info src_addr names one (default: the first "
			"non-loopback IPv4 interface that is up)");
	return &mrfi_prov;
}

int mrfi_err(int mr_rc)
{
	/* The ABI's error values are libfabric's (errno values, FI_ETRUNC). */
	return mr_rc;
}

void mrfi_log_last_error(enum fi_log_subsys subsys, const char *what, int rc)
{
	char buf[512] = "";
	mr_last_error(buf, sizeof(buf));
	MRFI_WARN(subsys, "%s failed: %s%s%s\n", what, fi_strerror(-rc),
		  buf[0] ? ": " : "", buf);
}

/* The IPv4 address of the interface named by FI_METAROCE_IFACE, else the
 * first non-loopback IPv4 interface that is up, else 127.0.0.1. */
int mrfi_local_ip(char *buf, size_t len)
{
	char *want = NULL;
	struct ifaddrs *ifa_list, *ifa;
	int found = 0;

	fi_param_get_str(&mrfi_prov, "iface", &want);
	if (getifaddrs(&ifa_list) == 0) {
		for (ifa = ifa_list; ifa && !found; ifa = ifa->ifa_next) {
			if (!ifa->ifa_addr || ifa->ifa_addr->sa_family != AF_INET)
				continue;
			if (want && *want) {
				if (strcmp(ifa->ifa_name, want))
					continue;
			} else if ((ifa->ifa_flags & IFF_LOOPBACK) ||
				   !(ifa->ifa_flags & IFF_UP)) {
				continue;
			}
			struct sockaddr_in *sin = (struct sockaddr_in *)ifa->ifa_addr;
			if (inet_ntop(AF_INET, &sin->sin_addr, buf, (socklen_t)len))
				found = 1;
		}
		freeifaddrs(ifa_list);
	}
	if (!found && want && *want) {
		MRFI_WARN(FI_LOG_CORE,
			  "FI_METAROCE_IFACE=%s: no IPv4 address on that "
			  "interface\n", want);
		return -FI_ENODATA;
	}
	if (!found)
		snprintf(buf, len, "127.0.0.1");
	return 0;
}

/* ---- hints ---- */

#define TX_OP_FLAGS_OK                                                      \
	(FI_COMPLETION | FI_INJECT | FI_INJECT_COMPLETE |                   \
	 FI_TRANSMIT_COMPLETE | FI_MORE | FI_REMOTE_CQ_DATA)
#define RX_OP_FLAGS_OK (FI_COMPLETION | FI_MORE)
#define COMPLETION_LEVELS                                                   \
	(FI_INJECT_COMPLETE | FI_TRANSMIT_COMPLETE | FI_DELIVERY_COMPLETE | \
	 FI_COMMIT_COMPLETE | FI_MATCH_COMPLETE)

#define NO(...)                                                  \
	do {                                                     \
		MRFI_INFO(FI_LOG_CORE, __VA_ARGS__);             \
		return false;                                    \
	} while (0)

static bool tx_hints_ok(const struct fi_tx_attr *t)
{
	if (t->caps & ~MRFI_CAPS)
		NO("tx_attr caps %#llx not supported\n",
		   (unsigned long long)(t->caps & ~MRFI_CAPS));
	if (t->op_flags & ~TX_OP_FLAGS_OK)
		NO("tx_attr op_flags %#llx not supported (transmit complete "
		   "is the strongest completion)\n",
		   (unsigned long long)(t->op_flags & ~TX_OP_FLAGS_OK));
	if (t->msg_order & ~FI_ORDER_SAS)
		NO("tx_attr msg_order %#llx: only FI_ORDER_SAS\n",
		   (unsigned long long)t->msg_order);
	if (t->comp_order)
		NO("tx_attr comp_order %#llx: completions are unordered\n",
		   (unsigned long long)t->comp_order);
	if (t->inject_size > mr_max_inject())
		NO("tx_attr inject_size %zu > %zu\n", t->inject_size,
		   mr_max_inject());
	if (t->size > MRFI_TX_SIZE)
		NO("tx_attr size %zu > %d\n", t->size, MRFI_TX_SIZE);
	if (t->iov_limit > MRFI_IOV_LIMIT)
		NO("tx_attr iov_limit %zu > %d\n", t->iov_limit, MRFI_IOV_LIMIT);
	if (t->rma_iov_limit)
		NO("tx_attr rma_iov_limit: no RMA\n");
	return true;
}

static bool rx_hints_ok(const struct fi_rx_attr *r)
{
	if (r->caps & ~MRFI_CAPS)
		NO("rx_attr caps %#llx not supported\n",
		   (unsigned long long)(r->caps & ~MRFI_CAPS));
	if (r->op_flags & ~RX_OP_FLAGS_OK)
		NO("rx_attr op_flags %#llx not supported\n",
		   (unsigned long long)(r->op_flags & ~RX_OP_FLAGS_OK));
	if (r->msg_order & ~FI_ORDER_SAS)
		NO("rx_attr msg_order %#llx: only FI_ORDER_SAS\n",
		   (unsigned long long)r->msg_order);
	if (r->comp_order)
		NO("rx_attr comp_order %#llx: completions are unordered\n",
		   (unsigned long long)r->comp_order);
	if (r->size > MRFI_RX_SIZE)
		NO("rx_attr size %zu > %d\n", r->size, MRFI_RX_SIZE);
	if (r->iov_limit > MRFI_IOV_LIMIT)
		NO("rx_attr iov_limit %zu > %d\n", r->iov_limit, MRFI_IOV_LIMIT);
	return true;
}

static bool ep_hints_ok(const struct fi_ep_attr *e)
{
	if (e->type != FI_EP_UNSPEC && e->type != FI_EP_RDM)
		NO("ep_attr type %d: only FI_EP_RDM\n", (int)e->type);
	if (e->protocol != FI_PROTO_UNSPEC)
		NO("ep_attr protocol %u\n", e->protocol);
	if (e->max_msg_size > mr_max_msg_size())
		NO("ep_attr max_msg_size %zu > %llu\n", e->max_msg_size,
		   (unsigned long long)mr_max_msg_size());
	if (e->max_order_raw_size || e->max_order_war_size ||
	    e->max_order_waw_size)
		NO("ep_attr max_order_*_size: no RMA\n");
	if (e->tx_ctx_cnt > 1 || e->rx_ctx_cnt > 1)
		NO("ep_attr tx/rx_ctx_cnt: one context each, none shared\n");
	if (e->auth_key_size)
		NO("ep_attr auth_key not supported\n");
	return true;
}

static bool domain_hints_ok(const struct fi_domain_attr *d)
{
	if (d->name && strcmp(d->name, MRFI_DOMAIN_NAME))
		NO("domain name %s: this provider's domain is %s\n", d->name,
		   MRFI_DOMAIN_NAME);
	if (d->mr_key_size > 8 || d->cq_data_size > MRFI_CQ_DATA_SIZE)
		NO("domain mr_key_size %zu / cq_data_size %zu too large\n",
		   d->mr_key_size, d->cq_data_size);
	if (d->max_ep_tx_ctx > 1 || d->max_ep_rx_ctx > 1 ||
	    d->max_ep_stx_ctx || d->max_ep_srx_ctx)
		NO("domain: no scalable endpoints or shared contexts\n");
	if (d->cntr_cnt)
		NO("domain cntr_cnt %zu: no counters\n", d->cntr_cnt);
	if (d->mr_iov_limit > 1)
		NO("domain mr_iov_limit %zu > 1\n", d->mr_iov_limit);
	if (d->caps & ~(FI_LOCAL_COMM | FI_REMOTE_COMM))
		NO("domain caps %#llx\n", (unsigned long long)d->caps);
	if (d->auth_key_size)
		NO("domain auth_key not supported\n");
	return true;
}

static bool hints_ok(const struct fi_info *h)
{
	if (h->caps & ~MRFI_CAPS)
		NO("caps %#llx not supported (no RMA, atomics, multi-recv, "
		   "HMEM)\n", (unsigned long long)(h->caps & ~MRFI_CAPS));
	if (h->addr_format != FI_FORMAT_UNSPEC)
		NO("addr_format %u: names are provider-specific "
		   "(FI_FORMAT_UNSPEC, %d bytes)\n", h->addr_format, MR_ADDR_LEN);
	if (h->src_addr && h->src_addrlen != MR_ADDR_LEN)
		NO("src_addrlen %zu != %d\n", h->src_addrlen, MR_ADDR_LEN);
	if (h->dest_addr && h->dest_addrlen != MR_ADDR_LEN)
		NO("dest_addrlen %zu != %d\n", h->dest_addrlen, MR_ADDR_LEN);
	if (h->ep_attr && !ep_hints_ok(h->ep_attr))
		return false;
	if (h->tx_attr && !tx_hints_ok(h->tx_attr))
		return false;
	if (h->rx_attr && !rx_hints_ok(h->rx_attr))
		return false;
	if (h->domain_attr && !domain_hints_ok(h->domain_attr))
		return false;
	if (h->fabric_attr && h->fabric_attr->name &&
	    strcmp(h->fabric_attr->name, MRFI_FABRIC_NAME))
		NO("fabric name %s: this provider's fabric is %s\n",
		   h->fabric_attr->name, MRFI_FABRIC_NAME);
	return true;
}

/* ---- addresses from node/service ---- */

/* "addr=" in MR_CONFIG, if any (the transport reads MR_CONFIG itself). */
bool mrfi_config_addr(char *buf, size_t len)
{
	const char *cfg = getenv("MR_CONFIG");
	while (cfg && *cfg) {
		const char *end = strchr(cfg, ',');
		size_t n = end ? (size_t)(end - cfg) : strlen(cfg);
		if (n > 5 && !strncmp(cfg, "addr=", 5) && n - 5 < len) {
			memcpy(buf, cfg + 5, n - 5);
			buf[n - 5] = '\0';
			return true;
		}
		cfg = end ? end + 1 : NULL;
	}
	return false;
}

static int name_from(const char *node, const char *service, bool local,
		     void **out)
{
	char host[INET6_ADDRSTRLEN] = "", str[INET6_ADDRSTRLEN + 32];
	unsigned long port = 0;
	size_t len = MR_ADDR_LEN;
	int rc;

	if (service) {
		char *end;
		port = strtoul(service, &end, 10);
		if (*end || port > 65535) {
			struct servent *se = getservbyname(service, "udp");
			if (!se) {
				MRFI_WARN(FI_LOG_CORE,
					  "service %s: not a UDP port\n", service);
				return -FI_ENODATA;
			}
			port = ntohs((uint16_t)se->s_port);
		}
	}
	if (node) {
		struct addrinfo ai = {.ai_family = AF_UNSPEC,
				      .ai_socktype = SOCK_DGRAM},
				*res;
		rc = getaddrinfo(node, NULL, &ai, &res);
		if (rc) {
			MRFI_WARN(FI_LOG_CORE, "node %s: %s\n", node,
				  gai_strerror(rc));
			return -FI_ENODATA;
		}
		void *a = res->ai_family == AF_INET
				  ? (void *)&((struct sockaddr_in *)res->ai_addr)->sin_addr
				  : (void *)&((struct sockaddr_in6 *)res->ai_addr)->sin6_addr;
		inet_ntop(res->ai_family, a, host, sizeof(host));
		freeaddrinfo(res);
	} else if (local) {
		if (!mrfi_config_addr(host, sizeof(host)) &&
		    (rc = mrfi_local_ip(host, sizeof(host))))
			return rc;
	} else {
		return 0;
	}
	if (strchr(host, ':'))
		snprintf(str, sizeof(str), "udp://[%s]:%lu", host, port);
	else
		snprintf(str, sizeof(str), "udp://%s:%lu", host, port);

	*out = calloc(1, MR_ADDR_LEN);
	if (!*out)
		return -FI_ENOMEM;
	rc = mr_addr_parse(str, *out, &len);
	if (rc) {
		mrfi_log_last_error(FI_LOG_CORE, str, rc);
		free(*out);
		*out = NULL;
		return -FI_ENODATA;
	}
	return 0;
}

static void *dup_addr(const void *a, size_t len)
{
	void *p = malloc(len);
	if (p)
		memcpy(p, a, len);
	return p;
}

/* ---- building the fi_info ---- */

static int fill_info(uint32_t version, const struct fi_info *h,
		     struct fi_info *fi)
{
	uint64_t caps;

	if (h && h->caps) {
		caps = h->caps & MRFI_ALL_PRIMARY_CAPS;
		if (!(caps & (FI_MSG | FI_TAGGED)))
			caps |= FI_MSG | FI_TAGGED;
		if (!(caps & (FI_SEND | FI_RECV)))
			caps |= FI_SEND | FI_RECV;
		caps |= MRFI_SECONDARY_CAPS;
	} else {
		caps = MRFI_CAPS;
	}
	fi->caps = caps;
	fi->mode = 0; /* the provider needs no mode bit; FI_CONTEXT is fine */
	fi->addr_format = FI_FORMAT_UNSPEC;

	fi->tx_attr->caps = caps & (FI_MSG | FI_TAGGED | FI_SEND |
				    FI_LOCAL_COMM | FI_REMOTE_COMM);
	fi->tx_attr->mode = 0;
	fi->tx_attr->op_flags = (h && h->tx_attr) ? h->tx_attr->op_flags : 0;
	if (!(fi->tx_attr->op_flags & COMPLETION_LEVELS))
		fi->tx_attr->op_flags |= FI_TRANSMIT_COMPLETE;
	fi->tx_attr->msg_order = FI_ORDER_SAS;
#if FI_MAJOR_VERSION < 2 /* deprecated in 2.x: left zero there */
	fi->tx_attr->comp_order = FI_ORDER_NONE;
#endif
	fi->tx_attr->inject_size = mr_max_inject();
	fi->tx_attr->size = MRFI_TX_SIZE;
	fi->tx_attr->iov_limit = MRFI_IOV_LIMIT;
	fi->tx_attr->rma_iov_limit = 0;

	fi->rx_attr->caps = caps & (FI_MSG | FI_TAGGED | FI_RECV |
				    FI_DIRECTED_RECV | FI_SOURCE |
				    FI_LOCAL_COMM | FI_REMOTE_COMM);
	fi->rx_attr->mode = 0;
	fi->rx_attr->op_flags = (h && h->rx_attr) ? h->rx_attr->op_flags : 0;
	fi->rx_attr->msg_order = FI_ORDER_SAS;
#if FI_MAJOR_VERSION < 2
	fi->rx_attr->comp_order = FI_ORDER_NONE;
#endif
	fi->rx_attr->total_buffered_recv = 0;
	fi->rx_attr->size = MRFI_RX_SIZE;
	fi->rx_attr->iov_limit = MRFI_IOV_LIMIT;

	fi->ep_attr->type = FI_EP_RDM;
	fi->ep_attr->protocol = FI_PROTO_UNSPEC;
	fi->ep_attr->protocol_version = MR_ABI_VERSION;
	fi->ep_attr->max_msg_size = (size_t)mr_max_msg_size();
	fi->ep_attr->msg_prefix_size = 0;
	/* libfabric's FI_TAG_GENERIC (not in the public headers): all 64 bits. */
	fi->ep_attr->mem_tag_format = 0xAAAAAAAAAAAAAAAAULL;
	fi->ep_attr->tx_ctx_cnt = 1;
	fi->ep_attr->rx_ctx_cnt = 1;

	const struct fi_domain_attr *hd = h ? h->domain_attr : NULL;
	struct fi_domain_attr *d = fi->domain_attr;
	d->name = strdup(MRFI_DOMAIN_NAME);
	if (!d->name)
		return -FI_ENOMEM;
	/* FI_THREAD_SAFE satisfies every threading level asked for. */
	d->threading = (hd && hd->threading) ? hd->threading : FI_THREAD_SAFE;
	/* The transport's progress thread makes progress automatic; an
	 * application asking for manual progress loses nothing. */
	d->control_progress = (hd && hd->control_progress) ? hd->control_progress
							   : FI_PROGRESS_AUTO;
	d->data_progress = (hd && hd->data_progress) ? hd->data_progress
						     : FI_PROGRESS_AUTO;
	d->resource_mgmt = (hd && hd->resource_mgmt) ? hd->resource_mgmt
						     : FI_RM_ENABLED;
	d->av_type = (hd && hd->av_type) ? hd->av_type : FI_AV_UNSPEC;
	(void)version;
#if FI_MAJOR_VERSION < 2 /* 2.x has no API before 1.5 and deprecates these */
	if (FI_VERSION_LT(version, FI_VERSION(1, 5)))
		d->mr_mode = (hd && (hd->mr_mode == FI_MR_BASIC ||
				     hd->mr_mode == FI_MR_SCALABLE))
				     ? hd->mr_mode
				     : FI_MR_SCALABLE;
	else
#endif
		d->mr_mode = 0; /* no registration needed: no RMA */
	d->mr_key_size = 8;
	d->cq_data_size = MRFI_CQ_DATA_SIZE;
	d->cq_cnt = 256;
	d->ep_cnt = 256;
	d->tx_ctx_cnt = 256;
	d->rx_ctx_cnt = 256;
	d->max_ep_tx_ctx = 1;
	d->max_ep_rx_ctx = 1;
	d->max_ep_stx_ctx = 0;
	d->max_ep_srx_ctx = 0;
	d->cntr_cnt = 0;
	d->mr_iov_limit = 1;
	d->caps = FI_LOCAL_COMM | FI_REMOTE_COMM;
	d->mode = 0;
	d->max_err_data = 0;
	d->mr_cnt = 65536;

	fi->fabric_attr->name = strdup(MRFI_FABRIC_NAME);
	if (!fi->fabric_attr->name)
		return -FI_ENOMEM;
	/* prov_name stays NULL: libfabric's core fills it in. */
	fi->fabric_attr->prov_version = MRFI_PROV_VERSION;
	return 0;
}

int mrfi_getinfo(uint32_t version, const char *node, const char *service,
		 uint64_t flags, const struct fi_info *hints,
		 struct fi_info **info)
{
	struct fi_info *fi;
	int rc;

	*info = NULL;
	if (hints && !hints_ok(hints))
		return -FI_ENODATA;

	fi = fi_allocinfo();
	if (!fi)
		return -FI_ENOMEM;
	rc = fill_info(version, hints, fi);
	if (rc)
		goto fail;

	if (hints && hints->src_addr) {
		fi->src_addr = dup_addr(hints->src_addr, MR_ADDR_LEN);
		fi->src_addrlen = MR_ADDR_LEN;
	}
	if (hints && hints->dest_addr) {
		fi->dest_addr = dup_addr(hints->dest_addr, MR_ADDR_LEN);
		fi->dest_addrlen = MR_ADDR_LEN;
	}
	if (node || service) {
		bool local = (flags & FI_SOURCE) || !node;
		void *name = NULL;
		rc = name_from(node, service, local, &name);
		if (rc)
			goto fail;
		if (name && local) {
			free(fi->src_addr);
			fi->src_addr = name;
			fi->src_addrlen = MR_ADDR_LEN;
		} else if (name) {
			free(fi->dest_addr);
			fi->dest_addr = name;
			fi->dest_addrlen = MR_ADDR_LEN;
		}
	}
	*info = fi;
	return 0;
fail:
	fi_freeinfo(fi);
	return rc;
}
