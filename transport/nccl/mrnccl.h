/* Internal interface of the NCCL net plugin: plugin.c implements the v12 semantics on
 * the transport's C ABI, adapters.c exports ncclNetPlugin_v6..v12 on top of it. */
#ifndef MRNCCL_H
#define MRNCCL_H

#include <stddef.h>
#include <stdint.h>
#include <net/if.h>
#include <pthread.h>

#include "metaroce.h"
#include "nccl/net.h"

#define MRN_PLUGIN_NAME "metaroce"
#define MRN_MAX_DEVS 16
#define MRN_MAX_RECVS 8               /* grouped receives (maxRecvs), NCCL's IB value */
#define MRN_MAX_REQS NCCL_NET_MAX_REQUESTS
#define MRN_MAX_COMMS 65536
#define MRN_DEFAULT_SPEED_MBPS 10000  /* when /sys/class/net/X/speed has none */
#define MRN_CLOSE_WAIT_MS 5000

/* Transport tag spaces: bits 63..62 pick the space, ids are 30 bits. */
#define MRN_ID_MASK 0x3fffffffu
#define MRN_TAG_HELLO (1ull << 62)
#define MRN_TAG_WELCOME (2ull << 62)

#define MRN_HANDLE_MAGIC 0x4d524e31u  /* "MRN1" */
#define MRN_HELLO_MAGIC 0x4d52484cu
#define MRN_WELCOME_MAGIC 0x4d525743u
#define MRN_COMM_MAGIC 0x4d52434du
#define MRN_MR_MAGIC 0x4d524d52u

#define WARN(...) mrn_log(NCCL_LOG_WARN, __FILE__, __LINE__, __VA_ARGS__)
#define INFO(...) mrn_log(NCCL_LOG_INFO, __FILE__, __LINE__, __VA_ARGS__)
void mrn_log(ncclDebugLogLevel level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* MR_NCCL_TRACE=PREFIX: every call NCCL makes, one line each, to PREFIX.<pid>. */
int mrn_tracing(void);
void mrn_trace(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#define TRACE(...) \
  do {                                  \
    if (mrn_tracing()) mrn_trace(__VA_ARGS__); \
  } while (0)

struct mrn_dev {
  char name[IF_NAMESIZE];
  char ip[64];
  char *pci_path;
  int speed_mbps;
  unsigned ifindex;
  pthread_mutex_t lock;        /* guards everything below and every comm on the device */
  mr_ep *ep;
  unsigned char self[MR_ADDR_LEN];
  size_t self_len;
  uint32_t next_id;
  int ncomms;
};

/* What listen writes into NCCL's handle (<= NCCL_NET_HANDLE_MAXSIZE). NCCL hands the
 * same buffer to every connect() call of one connection, so stage_comm keeps the
 * connecting comm between calls (zero on the wire). */
struct mrn_handle {
  uint32_t magic;
  uint32_t listen_id;
  uint32_t addr_len;
  unsigned char addr[MR_ADDR_LEN];
  struct mrn_comm *stage_comm;
};

struct mrn_hello {
  uint32_t magic;
  uint32_t send_id;
  uint32_t addr_len;
  unsigned char addr[MR_ADDR_LEN];
};

struct mrn_welcome {
  uint32_t magic;
  uint32_t recv_id;
};

struct mrn_req;

/* One transport operation: its completion's context. */
struct mrn_op {
  struct mrn_req *req; /* NULL for handshake operations */
  int done;
  int err;
  uint64_t len, olen;
  size_t cap;          /* the buffer's size (send: the message's) */
  mr_peer peer;
};

struct mrn_req {
  struct mrn_comm *comm;
  int used, zombie, kind, n, ndone;
  long polls; /* test() calls before done, for the trace */
  struct mrn_op ops[MRN_MAX_RECVS];
};

enum { MRN_LISTEN = 1, MRN_SEND = 2, MRN_RECV = 3 };

struct mrn_comm {
  uint32_t magic;
  int kind;
  long polls; /* connect/accept calls that returned NULL, for the trace */
  struct mrn_dev *dev;
  uint32_t id;         /* ours: listen id, or send id (in the data tags) */
  uint32_t remote_id;  /* recv comm: the sender's send id; send comm: the receiver's id */
  mr_peer peer;
  int hs_posted;
  struct mrn_op hs_op;        /* the handshake receive: HELLO (listen) or WELCOME (send) */
  int tx_posted;
  struct mrn_op tx_op;        /* send: our HELLO, with a completion so a dead peer shows */
  struct mrn_hello hello_out;
  struct mrn_hello hello;     /* listen: the HELLO being received */
  struct mrn_welcome welcome; /* send: the WELCOME being received */
  struct mrn_req reqs[MRN_MAX_REQS];
};

struct mrn_mr {
  uint32_t magic;
  uintptr_t base;
  size_t size;
};

/* Version-neutral properties (the v12 fields). */
struct mrn_props {
  char *name, *pciPath;
  uint64_t guid;
  int ptrSupport, speed, port;
  float latency;
  int maxComms, maxRecvs;
  size_t maxP2pBytes, maxCollBytes;
};

int mrn_ifname_selected(const char *spec, const char *name);
ncclResult_t mrn_init(ncclDebugLogger_t log, int version);
ncclResult_t mrn_finalize(void);
ncclResult_t mrn_devices(int *n);
ncclResult_t mrn_get_properties(int dev, struct mrn_props *p);
ncclResult_t mrn_listen(int dev, void *handle, void **listen_comm);
ncclResult_t mrn_connect(int dev, void *handle, void **send_comm);
ncclResult_t mrn_accept(void *listen_comm, void **recv_comm);
ncclResult_t mrn_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle);
ncclResult_t mrn_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset,
                               int fd, void **mhandle);
ncclResult_t mrn_dereg_mr(void *comm, void *mhandle);
ncclResult_t mrn_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle,
                       void **request);
ncclResult_t mrn_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags,
                       void **mhandles, void **request);
ncclResult_t mrn_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request);
ncclResult_t mrn_test(void *request, int *done, int *sizes);
ncclResult_t mrn_close_send(void *send_comm);
ncclResult_t mrn_close_recv(void *recv_comm);
ncclResult_t mrn_close_listen(void *listen_comm);

#endif
