/*
 * mrfi.h: internal declarations of the libfabric provider "metaroce".
 *
 * The provider is a thin layer over the MetaRoCE transport's C ABI
 * (metaroce.h). libfabric's utility code (ofi_util.h) is not installed by
 * Debian's libfabric-dev, so every object (fabric, eq, domain, mr, av, cq,
 * ep) is written here by hand. Only fi_prov_ini is exported.
 *
 * Object model and what the provider adds over the ABI:
 * - one fi_endpoint = one mr_ep (its UDP sockets, connections, matching
 *   queues and completion queue, driven by the transport's progress thread);
 * - an AV stores raw MR_ADDR_LEN-byte names; fi_addr_t is the index. Each
 *   endpoint bound to it turns an index into an mr_peer lazily (mr_av_insert
 *   on first use) and a completion's mr_peer back into an index (FI_SOURCE);
 * - a CQ is a software FIFO; reading it drains every bound endpoint's
 *   mr_poll and routes each completion to the endpoint's transmit or receive
 *   CQ (fi_pingpong binds two CQs to one endpoint);
 * - FI_PEEK completions (found, or FI_ENOMSG) are synthesized from mr_peek;
 * - FI_INJECT with a completion requested (fi_sendmsg(FI_INJECT)) copies the
 *   data into a provider bounce buffer, since MR_INJECT means "no completion".
 */
#ifndef MRFI_H
#define MRFI_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <sys/uio.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_atomic.h>
#include <rdma/fi_tagged.h>
#include <rdma/providers/fi_prov.h>
#include <rdma/providers/fi_log.h>

#include "metaroce.h"

#define MRFI_PROV_NAME "metaroce"
#define MRFI_FABRIC_NAME "metaroce"
#define MRFI_DOMAIN_NAME "metaroce"
#define MRFI_PROV_VERSION FI_VERSION(1, 0)
#define MRFI_FI_VERSION FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION)

/* What the provider implements; nothing else is advertised. */
#define MRFI_PRIMARY_CAPS \
	(FI_MSG | FI_TAGGED | FI_SEND | FI_RECV | FI_DIRECTED_RECV)
#define MRFI_SECONDARY_CAPS (FI_SOURCE | FI_LOCAL_COMM | FI_REMOTE_COMM)
#define MRFI_CAPS (MRFI_PRIMARY_CAPS | MRFI_SECONDARY_CAPS)
/* All primary capability bits libfabric 1.17 defines. */
#define MRFI_ALL_PRIMARY_CAPS                                               \
	(FI_MSG | FI_RMA | FI_TAGGED | FI_ATOMIC | FI_MULTICAST |           \
	 FI_COLLECTIVE | FI_NAMED_RX_CTX | FI_DIRECTED_RECV | FI_READ |     \
	 FI_WRITE | FI_RECV | FI_SEND | FI_REMOTE_READ | FI_REMOTE_WRITE |  \
	 FI_HMEM)

#define MRFI_TX_SIZE 1024
#define MRFI_RX_SIZE 1024
#define MRFI_IOV_LIMIT 1
#define MRFI_CQ_DATA_SIZE 8
#define MRFI_POLL_BATCH 64
#define MRFI_BOUNCE_SLOTS 256

#define MRFI_HIDDEN __attribute__((visibility("hidden")))

/* Provider-private operation flag (bits 60-63 are provider specific):
 * fi_inject and friends, which never write a completion. */
#define MRFI_NO_COMPLETION (1ULL << 63)

extern struct fi_provider mrfi_prov MRFI_HIDDEN;

#define MRFI_WARN(subsys, ...) FI_WARN(&mrfi_prov, subsys, __VA_ARGS__)
#define MRFI_INFO(subsys, ...) FI_INFO(&mrfi_prov, subsys, __VA_ARGS__)
#define MRFI_DBG(subsys, ...) FI_DBG(&mrfi_prov, subsys, __VA_ARGS__)

/* ---- a small uint64 -> uint64 open-addressing map ---- */
struct mrfi_map {
	uint64_t *keys;
	uint64_t *vals;
	uint8_t *used;
	size_t cap; /* power of two, or 0 */
	size_t len;
};
void mrfi_map_free(struct mrfi_map *m) MRFI_HIDDEN;
int mrfi_map_put(struct mrfi_map *m, uint64_t key, uint64_t val) MRFI_HIDDEN;
bool mrfi_map_get(const struct mrfi_map *m, uint64_t key, uint64_t *val) MRFI_HIDDEN;
void mrfi_map_del(struct mrfi_map *m, uint64_t key) MRFI_HIDDEN;
uint64_t mrfi_hash_bytes(const void *p, size_t n) MRFI_HIDDEN;

/* ---- objects ---- */
struct mrfi_fabric {
	struct fid_fabric fabric_fid;
	int refs; /* domains and EQs open on it */
	pthread_mutex_t lock;
};

struct mrfi_eq {
	struct fid_eq eq_fid;
	struct mrfi_fabric *fabric;
};

struct mrfi_domain {
	struct fid_domain domain_fid;
	struct mrfi_fabric *fabric;
	struct fi_info *info; /* fi_dupinfo of the info it was opened with */
	int refs;             /* AVs, CQs, endpoints, MRs */
	uint64_t next_key;
	pthread_mutex_t lock;
};

struct mrfi_mr {
	struct fid_mr mr_fid;
	struct mrfi_domain *domain;
};

struct mrfi_ep;

struct mrfi_av_entry {
	uint8_t addr[MR_ADDR_LEN];
	bool valid;
};

struct mrfi_av {
	struct fid_av av_fid;
	struct mrfi_domain *domain;
	enum fi_av_type type;
	pthread_mutex_t lock; /* guards everything below and every bound
			       * endpoint's peer caches */
	struct mrfi_av_entry *entries;
	size_t len, cap;
	struct mrfi_map by_addr; /* hash of address -> index */
	struct mrfi_ep **eps;    /* endpoints bound to this AV */
	size_t neps, cap_eps;
};

/* One completion as the provider keeps it until the application reads it. */
struct mrfi_cqe {
	void *op_context;
	uint64_t flags;
	size_t len;
	void *buf;
	uint64_t data;
	uint64_t tag;
	size_t olen;
	fi_addr_t src;
	int err;        /* positive FI_E* or 0 */
	int prov_errno; /* the transport's (negative) error, or 0 */
};

struct mrfi_cq {
	struct fid_cq cq_fid;
	struct mrfi_domain *domain;
	enum fi_cq_format format;
	enum fi_wait_obj wait_obj;
	uint32_t api_version;
	int refs; /* endpoints bound to it */

	/* Endpoints polled by this CQ. Held while polling so that an endpoint
	 * cannot be closed under a reader. */
	pthread_mutex_t eps_lock;
	struct mrfi_ep **eps;
	size_t neps, cap_eps;

	/* The FIFO (leaf lock). */
	pthread_mutex_t q_lock;
	struct mrfi_cqe *q;
	size_t q_head, q_len, q_cap; /* ring, q_cap a power of two */

	int signal_fd;  /* eventfd: fi_cq_signal, and entries pushed by others */
	bool signaled;  /* signal_fd holds a count (guarded by q_lock) */
	bool interrupted; /* fi_cq_signal: the next blocked sread returns */
	int waiters;      /* threads in fi_cq_sread (atomic) */
	int epoll_fd;   /* FI_WAIT_FD: signal_fd + every bound ep's mr_ep_fd */
};

struct mrfi_bounce {
	void *user_context;
	void *copy;
	int next_free; /* -1 ends the free list */
};

struct mrfi_ep {
	struct fid_ep ep_fid;
	struct mrfi_domain *domain;
	mr_ep *mr;
	int fd; /* mr_ep_fd: readable while completions are pending, or -1 */
	uint64_t caps;
	uint64_t tx_op_flags, rx_op_flags;
	size_t max_inject;
	struct mrfi_av *av;
	struct mrfi_cq *tx_cq, *rx_cq;
	bool tx_selective, rx_selective;
	bool enabled;
	size_t min_multi_recv;
	char local_name[128]; /* for logs */

	/* Serializes mr_poll on this endpoint and the routing of what it
	 * returned, so completions keep their order. */
	pthread_mutex_t poll_lock;

	/* Peer caches: guarded by av->lock. */
	mr_peer *peer_of; /* AV index -> mr_peer (MR_ANY_PEER: not yet) */
	size_t peer_of_len;
	struct mrfi_map addr_of; /* mr_peer -> AV index */

	/* Bounce buffers for FI_INJECT with a completion. */
	pthread_mutex_t bounce_lock;
	struct mrfi_bounce *bounce;
	int bounce_free;
};

/* ---- prov.c ---- */
int mrfi_getinfo(uint32_t version, const char *node, const char *service,
		 uint64_t flags, const struct fi_info *hints,
		 struct fi_info **info) MRFI_HIDDEN;
int mrfi_err(int mr_rc) MRFI_HIDDEN; /* transport rc -> libfabric rc */
void mrfi_log_last_error(enum fi_log_subsys subsys, const char *what,
			 int rc) MRFI_HIDDEN;
int mrfi_local_ip(char *buf, size_t len) MRFI_HIDDEN;
/* addr= from the environment variable MR_CONFIG, if it has one. */
bool mrfi_config_addr(char *buf, size_t len) MRFI_HIDDEN;

/* ---- fabric.c ---- */
int mrfi_fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
		     void *context) MRFI_HIDDEN;

/* ---- domain.c ---- */
int mrfi_domain_open(struct fid_fabric *fabric, struct fi_info *info,
		     struct fid_domain **domain, void *context) MRFI_HIDDEN;
void mrfi_domain_ref(struct mrfi_domain *d, int delta) MRFI_HIDDEN;

/* ---- av.c ---- */
int mrfi_av_open(struct fid_domain *domain, struct fi_av_attr *attr,
		 struct fid_av **av, void *context) MRFI_HIDDEN;
int mrfi_av_bind_ep(struct mrfi_av *av, struct mrfi_ep *ep) MRFI_HIDDEN;
void mrfi_av_unbind_ep(struct mrfi_av *av, struct mrfi_ep *ep) MRFI_HIDDEN;
int mrfi_av_peer(struct mrfi_ep *ep, fi_addr_t addr, mr_peer *peer) MRFI_HIDDEN;
fi_addr_t mrfi_av_src(struct mrfi_ep *ep, mr_peer peer) MRFI_HIDDEN;

/* ---- cq.c ---- */
int mrfi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
		 struct fid_cq **cq, void *context) MRFI_HIDDEN;
int mrfi_cq_add_ep(struct mrfi_cq *cq, struct mrfi_ep *ep) MRFI_HIDDEN;
void mrfi_cq_remove_ep(struct mrfi_cq *cq, struct mrfi_ep *ep) MRFI_HIDDEN;
void mrfi_cq_push(struct mrfi_cq *cq, const struct mrfi_cqe *e,
		  const struct mrfi_cq *poller) MRFI_HIDDEN;
int mrfi_cq_trywait(struct mrfi_cq *cq) MRFI_HIDDEN;
/* Drain ep's transport completions into its CQs (called with no CQ lock). */
int mrfi_ep_progress(struct mrfi_ep *ep, const struct mrfi_cq *poller) MRFI_HIDDEN;

/* ---- ep.c ---- */
int mrfi_ep_open(struct fid_domain *domain, struct fi_info *info,
		 struct fid_ep **ep, void *context) MRFI_HIDDEN;
struct mrfi_bounce *mrfi_ep_bounce_get(struct mrfi_ep *ep) MRFI_HIDDEN;
void mrfi_ep_bounce_put(struct mrfi_ep *ep, struct mrfi_bounce *b) MRFI_HIDDEN;
/* Push a completion the provider made itself (FI_PEEK) to the RX CQ. */
void mrfi_ep_push_rx(struct mrfi_ep *ep, const struct mrfi_cqe *e) MRFI_HIDDEN;

/* ---- msg.c / tagged.c ---- */
extern struct fi_ops_msg mrfi_msg_ops MRFI_HIDDEN;
extern struct fi_ops_tagged mrfi_tagged_ops MRFI_HIDDEN;
ssize_t mrfi_send(struct mrfi_ep *ep, const void *buf, size_t len,
		  fi_addr_t dest, uint64_t tag, uint64_t data, uint64_t flags,
		  void *context, bool tagged) MRFI_HIDDEN;
ssize_t mrfi_recv(struct mrfi_ep *ep, void *buf, size_t len, fi_addr_t src,
		  uint64_t tag, uint64_t ignore, uint64_t flags, void *context,
		  bool tagged) MRFI_HIDDEN;
int mrfi_iov_one(const struct iovec *iov, size_t count, void **buf,
		 size_t *len) MRFI_HIDDEN;

/* ---- stubs.c ---- */
extern struct fi_ops_rma mrfi_no_rma_ops MRFI_HIDDEN;
extern struct fi_ops_atomic mrfi_no_atomic_ops MRFI_HIDDEN;
extern struct fi_ops_cm mrfi_cm_ops MRFI_HIDDEN;
int mrfi_no_bind(struct fid *fid, struct fid *bfid, uint64_t flags) MRFI_HIDDEN;
int mrfi_no_control(struct fid *fid, int command, void *arg) MRFI_HIDDEN;
int mrfi_no_ops_open(struct fid *fid, const char *name, uint64_t flags,
		     void **ops, void *context) MRFI_HIDDEN;
int mrfi_no_tostr(const struct fid *fid, char *buf, size_t len) MRFI_HIDDEN;
int mrfi_no_ops_set(struct fid *fid, const char *name, uint64_t flags,
		    void *ops, void *context) MRFI_HIDDEN;

static inline struct mrfi_ep *mrfi_ep_of(struct fid_ep *ep)
{
	return (struct mrfi_ep *)ep;
}

#endif /* MRFI_H */
