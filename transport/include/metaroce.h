/*
 * metaroce.h: the C ABI of the MetaRoCE software transport (libmetaroce).
 *
 * One endpoint (mr_ep) is a set of UDP sockets on one local address: socket 0
 * receives, every socket is one path (its source port is what ECMP hashes). An
 * endpoint holds its connections (one per peer endpoint, set up lazily on the
 * first send), its tag-matching queues and its completion queue. A progress
 * thread per endpoint receives, acknowledges, retransmits and paces, so a caller
 * busy computing still acknowledges.
 *
 * Every function is thread-safe (FI_THREAD_SAFE), never aborts the process (a
 * Rust panic inside becomes MR_EIO and a failed endpoint), and returns 0 or a
 * negative error whose values are the same as libfabric's FI_E* (errno values,
 * FI_ETRUNC 265).
 */
#ifndef METAROCE_H
#define METAROCE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MR_ABI_VERSION 1u

/* Errors (negated on return). */
#define MR_EAGAIN 11      /* no resources now: progress or retry later */
#define MR_EINVAL 22      /* bad argument or config; mr_last_error() names it */
#define MR_ENOMEM 12
#define MR_ENOENT 2       /* mr_cancel: nothing with that context */
#define MR_ENOMSG 42      /* mr_peek: no matching message */
#define MR_EIO 5          /* endpoint failed (I/O error or internal panic) */
#define MR_ETIMEDOUT 110  /* peer unreachable for abort_timeout */
#define MR_ECONNRESET 104 /* peer restarted (new incarnation) */
#define MR_ECANCELED 125
#define MR_ETRUNC 265     /* message longer than the receive buffer */

typedef struct mr_ep mr_ep;

/* A peer handle from mr_av_insert (or assigned on first contact). */
typedef uint64_t mr_peer;
#define MR_ANY_PEER UINT64_MAX

/* An endpoint's address: what mr_ep_name writes and mr_av_insert reads. */
#define MR_ADDR_LEN 24

/* Operation flags (mr_send, mr_recv, mr_peek) and completion flags. */
#define MR_TAGGED (1u << 0)          /* tagged match space (else the untagged FI_MSG space) */
#define MR_REMOTE_CQ_DATA (1u << 1)  /* send: carry cq_data; completion: data is valid */
#define MR_INJECT (1u << 2)          /* send: buffer reusable on return, no completion */
#define MR_NO_COMPLETION (1u << 3)   /* send/recv: do not write a successful completion */
#define MR_CLAIM (1u << 4)           /* peek: claim the match for context; recv: take the claimed one */
#define MR_DISCARD (1u << 5)         /* peek/recv with MR_CLAIM: drop the message */
#define MR_SEND (1u << 8)            /* completion of a send */
#define MR_RECV (1u << 9)            /* completion of a receive */

struct mr_completion {
  void *context;      /* the caller's context of the operation */
  uint32_t flags;     /* MR_SEND or MR_RECV, | MR_TAGGED, | MR_REMOTE_CQ_DATA */
  int32_t err;        /* 0, or a negative MR_E*: -MR_ETRUNC, -MR_ECANCELED, -MR_ETIMEDOUT ... */
  uint64_t len;       /* bytes placed in buf (receive) or sent (send) */
  void *buf;          /* the receive buffer */
  uint64_t data;      /* remote CQ data, when MR_REMOTE_CQ_DATA */
  uint64_t tag;       /* the message's tag (receive) */
  mr_peer peer;       /* receive: the sender; send: the destination */
  uint64_t olen;      /* -MR_ETRUNC: bytes that did not fit */
};

/*
 * Open an endpoint. config: NULL or "key=value,key=value"; unknown keys and bad
 * values fail with -MR_EINVAL and mr_last_error() naming the key, the value and
 * what is allowed. Keys (defaults in brackets; the env var MR_CONFIG is read
 * first, config overrides it):
 *   addr=IP              local IPv4 or IPv6 address to bind [0.0.0.0 refused: needs a routable address]
 *   ports=LO-HI          UDP port range for the endpoint's sockets: socket 0 (the
 *                        endpoint's name) takes the first free port from LO [ephemeral]
 *   paths=N              paths (sockets) per endpoint, 1..64 [8]
 *   mtu=N                path MTU in bytes, 576..9216 [from the route, else 1500]
 *   abort_timeout_ms=N   fail a peer silent for this long [30000]
 *   progress=thread|manual  [thread]
 *   rate_mbps=N          the receiver's capacity it shares among senders [link speed, else 10000]
 *   max_conns=N          [1024]
 */
int mr_ep_open(const char *config, mr_ep **out);
int mr_ep_close(mr_ep *ep); /* lingers until sent data is acknowledged (bounded) */
int mr_ep_name(mr_ep *ep, void *addr, size_t *len);          /* MR_ADDR_LEN bytes; -MR_ETRUNC if *len is smaller */
int mr_addr_format(const void *addr, size_t len, char *buf, size_t buflen); /* "udp://ip:port" */
int mr_addr_parse(const char *str, void *addr, size_t *len);

/* Address vector: the same address always gives the same peer. */
int mr_av_insert(mr_ep *ep, const void *addr, size_t len, mr_peer *out);
int mr_av_remove(mr_ep *ep, mr_peer peer);
int mr_av_lookup(mr_ep *ep, mr_peer peer, void *addr, size_t *len);

/*
 * Send len bytes to peer. The buffer stays the caller's until the send's
 * completion (unless MR_INJECT, for len <= mr_max_inject()), which is written
 * once the receiver has acknowledged every byte (FI_TRANSMIT_COMPLETE).
 * Messages between one pair of endpoints are matched in the order they were
 * sent (FI_ORDER_SAS). -MR_EAGAIN: too many sends outstanding.
 */
int mr_send(mr_ep *ep, mr_peer peer, const void *buf, size_t len, uint64_t tag,
            uint64_t cq_data, uint32_t flags, void *context);

/*
 * Post a receive. peer MR_ANY_PEER matches any sender. With MR_TAGGED a message
 * matches when (msg_tag & ~ignore) == (tag & ~ignore); the earliest posted
 * matching receive wins. With MR_CLAIM: takes the message claimed by an earlier
 * mr_peek(..., MR_CLAIM, context) (tag/ignore/peer ignored).
 */
int mr_recv(mr_ep *ep, mr_peer peer, void *buf, size_t len, uint64_t tag,
            uint64_t ignore, uint32_t flags, void *context);

/*
 * Look for a message that arrived unmatched. 0: found, *out describes it (len is
 * the full message length, buf NULL); with MR_CLAIM it is held for context
 * (take it with mr_recv(..., MR_CLAIM, context), or drop it with
 * mr_recv(..., MR_CLAIM | MR_DISCARD, context), which writes a completion);
 * with MR_DISCARD alone the match is dropped. -MR_ENOMSG: none.
 */
int mr_peek(mr_ep *ep, mr_peer peer, uint64_t tag, uint64_t ignore, uint32_t flags,
            void *context, struct mr_completion *out);

/* Cancel a posted receive: 0 and a -MR_ECANCELED completion follows, or -MR_ENOENT. */
int mr_cancel(mr_ep *ep, void *context);

/* Completions: mr_poll never blocks; mr_wait blocks up to timeout_ms (-1: forever). */
int mr_poll(mr_ep *ep, struct mr_completion *out, size_t max);
int mr_wait(mr_ep *ep, int timeout_ms);
int mr_ep_fd(mr_ep *ep);      /* readable exactly while completions are pending */
/*
 * Do pending I/O now in the calling thread and return the completions pending
 * (or -MR_E*). progress=manual: the only progress. With the progress thread:
 * done only if that thread is not at it, never waiting, so a thread spinning on
 * its completions receives and acknowledges without waking another thread; the
 * progress thread stands by while calls come within 50 us of each other and
 * looks every 250 us. Call mr_progress_release before blocking on mr_ep_fd
 * (mr_wait does it itself) so that the progress thread takes over at once.
 */
int mr_progress(mr_ep *ep);
int mr_progress_release(mr_ep *ep);

size_t mr_max_inject(void);
uint64_t mr_max_msg_size(void);

/* Counters: whole endpoint, and per path of one peer. */
struct mr_counters {
  uint64_t pkts_sent, pkts_rcvd, bytes_sent, bytes_rcvd; /* payload bytes */
  uint64_t msgs_sent, msgs_rcvd;
  uint64_t retransmits;      /* data copies sent again: loss resends and tail-loss probes */
  uint64_t dup_rcvd;         /* duplicates seen by this receiver: spurious retransmits of the peer */
  uint64_t sack_holes;       /* gaps reported by SACK */
  uint64_t ce_rcvd;          /* CE-marked packets received */
  uint64_t ce_echoed;        /* CE marks the peers reported back to this sender */
  uint64_t rtos, tlps;       /* retransmission timeouts, tail-loss probes */
  uint64_t path_rotations;   /* source ports changed after repeated failure */
  uint64_t drops_crc, drops_malformed, drops_unknown_conn, drops_stale; /* counted drops */
  uint64_t rnr_waits;        /* sends held for receiver credit ("not ready", not loss) */
  uint64_t conns_active, conns_opened, conns_failed;
};
int mr_get_counters(mr_ep *ep, struct mr_counters *out);

struct mr_path_stats {
  uint16_t src_port;
  uint16_t state;            /* 0 active, 1 suspect (recent loss/CE), 2 failed */
  uint32_t cwnd_bytes;
  uint32_t srtt_us, rttvar_us;
  uint32_t inflight_bytes;
  uint64_t pkts_sent, retransmits, losses, ce_echoed;
};
int mr_get_path_stats(mr_ep *ep, mr_peer peer, struct mr_path_stats *out, size_t max);

/* The thread's last error text (for -MR_EINVAL and others). */
size_t mr_last_error(char *buf, size_t len);
const char *mr_strerror(int err);
uint32_t mr_abi_version(void);

#ifdef __cplusplus
}
#endif
#endif
