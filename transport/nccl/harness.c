/*
 * nccl-net-check: NCCL's call contract for a net plugin, replayed between two processes.
 *
 * NCCL cannot start without a GPU, so this program does what NCCL's transport setup
 * and proxy do with a net plugin, and checks the answers:
 *   - load: dlopen("libnccl-net-<name>.so") (NCCL_NET_PLUGIN's naming rule, found on
 *     the loader's path) and dlsym("ncclNetPlugin_v<N>"), calling it through that
 *     version's own struct (nccl/net.h), so each version's adapter is tested by itself;
 *   - init, devices, getProperties (host memory only, speed, maxRecvs ...);
 *   - listen on both ranks, the handles swapped over a TCP bootstrap (NCCL's own
 *     bootstrap is TCP too), then connect and accept polled together until both
 *     return a comm (they return success with NULL until then);
 *   - regMr of host memory, and the refusal of CUDA memory and dma-buf;
 *   - 32 isends and 32 irecvs in flight per comm (NCCL_NET_MAX_REQUESTS; a 33rd is
 *     answered with request NULL), receives larger than their sends (test returns the
 *     real size), a zero-byte message;
 *   - grouped receives (irecv with maxRecvs buffers and tags, several groups in flight,
 *     the sender sending each group's tags in reverse order);
 *   - sends that arrive before their receives are posted; 4 more comm pairs on the
 *     device at once with the same tags (nothing may cross comms); 2 threads driving
 *     their own comm pairs at once (NCCL's proxy threads);
 *   - iflush (a no-op for host memory), a bulk transfer in both directions at once with
 *     8 in flight (NCCL_STEPS) and its goodput, every byte checked;
 *   - closeSend, closeRecv, closeListen, deregMr, finalize (v12).
 * Rank 0 listens on the bootstrap address, rank 1 connects to it:
 *   nccl-net-check --rank 0 --bootstrap 10.202.0.2:5555 --version 12 [--ifname data]
 * Prints "ok <step>" lines, "RESULT {json}" lines and "ALL OK"; exit 0 only if all held.
 */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "nccl/net.h"

#define MAXREQ NCCL_NET_MAX_REQUESTS
#define MAX_GROUP 8

static int V;           /* the plugin version under test */
static const void *P;   /* its ncclNetPlugin_v<V> */
static void *ctx;       /* v12's per-communicator context */
static int rank;
static int verbose;

static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stdout, "FAIL rank %d: ", rank);
  vfprintf(stdout, fmt, ap);
  fprintf(stdout, "\n");
  va_end(ap);
  fflush(stdout);
  exit(1);
}

/* The watchdog's message: which rank, after how long. Only async-signal-safe calls. */
static char alarm_msg[96];
static size_t alarm_len;

static void on_alarm(int sig) {
  (void)sig;
  if (write(STDOUT_FILENO, alarm_msg, alarm_len) < 0) _exit(2);
  _exit(1);
}

static void ok(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stdout, "ok rank %d v%d: ", rank, V);
  vfprintf(stdout, fmt, ap);
  fprintf(stdout, "\n");
  va_end(ap);
  fflush(stdout);
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                   const char *fmt, ...) {
  (void)flags;
  if (level > NCCL_LOG_WARN && !verbose) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "[plugin %s %s:%d] ", level == NCCL_LOG_WARN ? "WARN" : "INFO", file, line);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define CHECK(call)                                                          \
  do {                                                                       \
    ncclResult_t r_ = (call);                                                \
    if (r_ != ncclSuccess) fail("%s returned %d (line %d)", #call, r_, __LINE__); \
  } while (0)

/* ---- calls through the version's own struct ---------------------------------------- */

#define N6 ((const ncclNet_v6_t *)P)
#define N7 ((const ncclNet_v7_t *)P)
#define N8 ((const ncclNet_v8_t *)P)
#define N9 ((const ncclNet_v9_t *)P)
#define N10 ((const ncclNet_v10_t *)P)
#define N11 ((const ncclNet_v11_t *)P)
#define N12 ((const ncclNet_v12_t *)P)

/* The properties every version has, plus what the later ones add (-1 when absent). */
struct props {
  const char *name, *pciPath;
  uint64_t guid;
  int ptrSupport, speed, port, maxComms, maxRecvs;
  float latency;
  int regIsGlobal, forceFlush, netDeviceType, vndevs, vdev0, maxMultiRequestSize;
  long long maxP2pBytes;
};

static ncclResult_t n_init(void) {
  switch (V) {
    case 6: return N6->init(logger);
    case 7: return N7->init(logger);
    case 8: return N8->init(logger);
    case 9: return N9->init(logger);
    case 10: return N10->init(logger, NULL);
    case 11: return N11->init(logger, NULL);
    default: {
      ncclNetCommConfig_v12_t cfg = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
      return N12->init(&ctx, 0x5eed, &cfg, logger, NULL);
    }
  }
}

static ncclResult_t n_devices(int *n) {
  switch (V) {
    case 6: return N6->devices(n);
    case 7: return N7->devices(n);
    case 8: return N8->devices(n);
    case 9: return N9->devices(n);
    case 10: return N10->devices(n);
    case 11: return N11->devices(n);
    default: return N12->devices(n);
  }
}

#define BASE_PROPS(q)                                                        \
  do {                                                                       \
    out->name = (q).name, out->pciPath = (q).pciPath, out->guid = (q).guid;  \
    out->ptrSupport = (q).ptrSupport, out->speed = (q).speed;                \
    out->port = (q).port, out->latency = (q).latency;                        \
    out->maxComms = (q).maxComms, out->maxRecvs = (q).maxRecvs;              \
  } while (0)
#define V9_PROPS(q)                                                          \
  do {                                                                       \
    out->regIsGlobal = (q).regIsGlobal, out->forceFlush = (q).forceFlush;    \
    out->netDeviceType = (q).netDeviceType, out->vndevs = (q).vProps.ndevs;  \
    out->vdev0 = (q).vProps.devs[0], out->maxP2pBytes = (long long)(q).maxP2pBytes; \
  } while (0)

static ncclResult_t n_props(int dev, struct props *out) {
  ncclResult_t r;
  memset(out, 0xff, sizeof *out);
  out->name = out->pciPath = NULL;
  switch (V) {
    case 6: { ncclNetProperties_v6_t q; if ((r = N6->getProperties(dev, &q))) return r; BASE_PROPS(q); break; }
    case 7: { ncclNetProperties_v7_t q; if ((r = N7->getProperties(dev, &q))) return r; BASE_PROPS(q);
              out->netDeviceType = q.netDeviceType; break; }
    case 8: { ncclNetProperties_v8_t q; if ((r = N8->getProperties(dev, &q))) return r; BASE_PROPS(q);
              out->netDeviceType = q.netDeviceType; out->regIsGlobal = q.regIsGlobal; break; }
    case 9: { ncclNetProperties_v9_t q; if ((r = N9->getProperties(dev, &q))) return r; BASE_PROPS(q); V9_PROPS(q); break; }
    case 10: { ncclNetProperties_v10_t q; if ((r = N10->getProperties(dev, &q))) return r; BASE_PROPS(q); V9_PROPS(q); break; }
    case 11: { ncclNetProperties_v11_t q; if ((r = N11->getProperties(dev, &q))) return r; BASE_PROPS(q); V9_PROPS(q); break; }
    default: { ncclNetProperties_v12_t q; if ((r = N12->getProperties(dev, &q))) return r; BASE_PROPS(q); V9_PROPS(q);
               out->maxMultiRequestSize = q.maxMultiRequestSize; break; }
  }
  return ncclSuccess;
}

static ncclResult_t n_listen(int dev, void *h, void **lc) {
  switch (V) {
    case 6: return N6->listen(dev, h, lc);
    case 7: return N7->listen(dev, h, lc);
    case 8: return N8->listen(dev, h, lc);
    case 9: return N9->listen(dev, h, lc);
    case 10: return N10->listen(dev, h, lc);
    case 11: return N11->listen(dev, h, lc);
    default: return N12->listen(ctx, dev, h, lc);
  }
}

static ncclResult_t n_connect(int dev, void *h, void **sc) {
  ncclNetDeviceHandle_v7_t *dc = NULL; /* NULL: no device offload requested */
  ncclNetCommConfig_v10_t cfg = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
  switch (V) {
    case 6: return N6->connect(dev, h, sc);
    case 7: return N7->connect(dev, h, sc, &dc);
    case 8: return N8->connect(dev, h, sc, &dc);
    case 9: return N9->connect(dev, h, sc, &dc);
    case 10: return N10->connect(dev, &cfg, h, sc, &dc);
    case 11: return N11->connect(dev, (ncclNetCommConfig_v11_t *)&cfg, h, sc, &dc);
    default: return N12->connect(ctx, dev, h, sc, &dc);
  }
}

static ncclResult_t n_accept(void *lc, void **rc) {
  ncclNetDeviceHandle_v7_t *dc = NULL;
  switch (V) {
    case 6: return N6->accept(lc, rc);
    case 7: return N7->accept(lc, rc, &dc);
    case 8: return N8->accept(lc, rc, &dc);
    case 9: return N9->accept(lc, rc, &dc);
    case 10: return N10->accept(lc, rc, &dc);
    case 11: return N11->accept(lc, rc, &dc);
    default: return N12->accept(lc, rc, &dc);
  }
}

static ncclResult_t n_reg(void *comm, void *data, size_t size, int type, void **mh) {
  switch (V) {
    case 6: return N6->regMr(comm, data, (int)size, type, mh);
    case 7: return N7->regMr(comm, data, (int)size, type, mh);
    case 8: return N8->regMr(comm, data, size, type, mh);
    case 9: return N9->regMr(comm, data, size, type, mh);
    case 10: return N10->regMr(comm, data, size, type, mh);
    case 11: return N11->regMr(comm, data, size, type, mh);
    default: return N12->regMr(comm, data, size, type, mh);
  }
}

/* regMrDmaBuf sits at the same place with the same signature in every version. */
static ncclResult_t n_reg_dmabuf(void *comm, void *data, size_t size, void **mh) {
  if (N6->regMrDmaBuf == NULL) return ncclInternalError;
  return N6->regMrDmaBuf(comm, data, size, NCCL_PTR_DMABUF, 0, -1, mh);
}

static ncclResult_t n_dereg(void *comm, void *mh) {
  switch (V) {
    case 6: return N6->deregMr(comm, mh);
    case 7: return N7->deregMr(comm, mh);
    case 8: return N8->deregMr(comm, mh);
    case 9: return N9->deregMr(comm, mh);
    case 10: return N10->deregMr(comm, mh);
    case 11: return N11->deregMr(comm, mh);
    default: return N12->deregMr(comm, mh);
  }
}

static ncclResult_t n_isend(void *sc, void *data, size_t size, int tag, void *mh, void **req) {
  switch (V) {
    case 6: return N6->isend(sc, data, (int)size, tag, mh, req);
    case 7: return N7->isend(sc, data, (int)size, tag, mh, req);
    case 8: return N8->isend(sc, data, (int)size, tag, mh, req);
    case 9: return N9->isend(sc, data, size, tag, mh, req);
    case 10: return N10->isend(sc, data, size, tag, mh, NULL, req);
    case 11: return N11->isend(sc, data, size, tag, mh, NULL, req);
    default: return N12->isend(sc, data, size, tag, mh, NULL, req);
  }
}

static ncclResult_t n_irecv(void *rc, int n, void **data, size_t *sizes, int *tags, void **mh,
                            void **req) {
  int isz[MAX_GROUP];
  void *ph[MAX_GROUP] = {0};
  for (int i = 0; i < n && i < MAX_GROUP; i++) isz[i] = (int)sizes[i];
  switch (V) {
    case 6: return N6->irecv(rc, n, data, isz, tags, mh, req);
    case 7: return N7->irecv(rc, n, data, isz, tags, mh, req);
    case 8: return N8->irecv(rc, n, data, isz, tags, mh, req);
    case 9: return N9->irecv(rc, n, data, sizes, tags, mh, req);
    case 10: return N10->irecv(rc, n, data, sizes, tags, mh, ph, req);
    case 11: return N11->irecv(rc, n, data, sizes, tags, mh, ph, req);
    default: return N12->irecv(rc, n, data, sizes, tags, mh, ph, req);
  }
}

/* iflush, test and the closes have one signature and place in every version. */
static ncclResult_t n_iflush(void *rc, int n, void **data, int *sizes, void **mh, void **req) {
  return N6->iflush(rc, n, data, sizes, mh, req);
}
static ncclResult_t n_test(void *req, int *done, int *sizes) { return N6->test(req, done, sizes); }
static ncclResult_t n_close_send(void *c) { return N6->closeSend(c); }
static ncclResult_t n_close_recv(void *c) { return N6->closeRecv(c); }
static ncclResult_t n_close_listen(void *c) { return N6->closeListen(c); }

/* ---- bootstrap: a TCP socket between the two ranks ---------------------------------- */

static int boot_fd = -1;

static void boot_open(const char *hostport, double timeout) {
  char host[64];
  const char *colon = strrchr(hostport, ':');
  if (colon == NULL || (size_t)(colon - hostport) >= sizeof host)
    fail("--bootstrap %s: want IPv4:PORT", hostport);
  memcpy(host, hostport, (size_t)(colon - hostport));
  host[colon - hostport] = 0;
  struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(colon + 1))};
  if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) fail("--bootstrap %s: not an IPv4 address", host);
  int one = 1;
  if (rank == 0) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(l, 1) != 0)
      fail("bootstrap listen on %s: %s", hostport, strerror(errno));
    boot_fd = accept(l, NULL, NULL);
    close(l);
  } else {
    double t0 = now_s();
    for (;;) {
      boot_fd = socket(AF_INET, SOCK_STREAM, 0);
      if (connect(boot_fd, (struct sockaddr *)&sa, sizeof sa) == 0) break;
      close(boot_fd);
      boot_fd = -1;
      if (now_s() - t0 > timeout) fail("bootstrap connect to %s: %s", hostport, strerror(errno));
      usleep(50000);
    }
  }
  if (boot_fd < 0) fail("bootstrap: %s", strerror(errno));
  setsockopt(boot_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

static void boot_xchg(const void *mine, void *theirs, size_t len) {
  if (write(boot_fd, mine, len) != (ssize_t)len) fail("bootstrap write: %s", strerror(errno));
  size_t got = 0;
  while (got < len) {
    ssize_t n = read(boot_fd, (char *)theirs + got, len - got);
    if (n <= 0) fail("bootstrap read: peer gone");
    got += (size_t)n;
  }
}

static void barrier(void) {
  char a = 'b', b;
  boot_xchg(&a, &b, 1);
}

/* ---- data patterns ------------------------------------------------------------------ */

static uint8_t pat(int dir, uint32_t msg, size_t k) {
  return (uint8_t)(k * 131u + msg * 7u + (uint32_t)dir * 61u + 1u + (k >> 12));
}

static void fill(uint8_t *buf, size_t len, int dir, uint32_t msg) {
  for (size_t k = 0; k < len; k++) buf[k] = pat(dir, msg, k);
}

static void verify(const uint8_t *buf, size_t len, int dir, uint32_t msg, const char *what) {
  for (size_t k = 0; k < len; k++)
    if (buf[k] != pat(dir, msg, k))
      fail("%s: message %u byte %zu is %#x, want %#x", what, msg, k, buf[k], pat(dir, msg, k));
}

/* Wait for one request; returns sizes[0]. */
static int wait_req(void *req, int *sizes, const char *what) {
  int done = 0, tmp[MAX_GROUP];
  double t0 = now_s();
  if (sizes == NULL) sizes = tmp;
  while (!done) {
    CHECK(n_test(req, &done, sizes));
    if (!done && now_s() - t0 > 60) fail("%s: not complete after 60 s", what);
    if (!done) sched_yield(); /* like NCCL's idle proxy thread */
  }
  return sizes[0];
}

static void *post_send(void *sc, void *data, size_t size, int tag, void *mh) {
  void *req = NULL;
  double t0 = now_s();
  for (;;) {
    CHECK(n_isend(sc, data, size, tag, mh, &req));
    if (req != NULL) return req;
    if (now_s() - t0 > 10) fail("isend: request NULL for 10 s");
    usleep(100);
  }
}

static void *post_recv(void *rc, int n, void **data, size_t *sizes, int *tags, void **mh) {
  void *req = NULL;
  double t0 = now_s();
  for (;;) {
    /* NCCL may pass this hint in *request; the plugin must still give a request */
    if (V >= 9) req = (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION;
    CHECK(n_irecv(rc, n, data, sizes, tags, mh, &req));
    if (req != NULL && req != (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION) return req;
    if (now_s() - t0 > 10) fail("irecv: request NULL for 10 s");
    usleep(100);
  }
}

/* ---- replay of a recorded call trace (MR_NCCL_TRACE) ------------------------------- */

/* Pointers in a trace name objects of the recording process; these tables map them to
 * this process's objects, updated in trace order (a freed object's address is reused by
 * a later one). Listens, made up front, go by their id. Small linear tables. */
struct map {
  uint64_t key;
  void *val;
};
struct table {
  struct map *e;
  int n, cap;
};

static void *tget(struct table *t, uint64_t key) {
  for (int i = t->n - 1; i >= 0; i--)
    if (t->e[i].key == key) return t->e[i].val;
  return NULL;
}

static void tput(struct table *t, uint64_t key, void *val) {
  for (int i = 0; i < t->n; i++)
    if (t->e[i].key == key) {
      t->e[i].val = val;
      return;
    }
  if (t->n == t->cap) {
    t->cap = t->cap ? 2 * t->cap : 64;
    t->e = realloc(t->e, (size_t)t->cap * sizeof *t->e);
    if (t->e == NULL) fail("out of memory");
  }
  t->e[t->n++] = (struct map){key, val};
}

static uint64_t num_at(const char *line, const char *key) {
  const char *p = strstr(line, key);
  if (p == NULL) fail("trace line without %s: %s", key, line);
  p += strlen(key);
  if (strncmp(p, "(nil)", 5) == 0) return 0;
  return strtoull(p, NULL, 0);
}

static int list_at(const char *line, const char *key, uint64_t *out, int max) {
  const char *p = strstr(line, key);
  if (p == NULL || p[strlen(key)] != '[') fail("trace line without %s[...]: %s", key, line);
  p += strlen(key) + 1;
  int n = 0;
  while (*p && *p != ']' && n < max) {
    char *end;
    out[n++] = strtoull(p, &end, 0);
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

struct region {
  uint64_t base; /* the recording's address */
  uint8_t *buf;  /* ours */
  size_t size;
  void *mh;      /* ours */
};

struct pending {
  uint32_t listen_id; /* the peer's */
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *sc;
};

static struct pending *pend;
static int npend;
static int replay_dev;

static void poll_connects(void) {
  for (int i = 0; i < npend; i++)
    if (pend[i].sc == NULL) CHECK(n_connect(replay_dev, pend[i].handle, &pend[i].sc));
}

static void *ptr_in(struct table *regions, uint64_t mh, uint64_t data, uint64_t size) {
  if (mh == 0) {
    static uint8_t scratch[64];
    if (size > 0) fail("replay: %llu bytes without a memory handle", (unsigned long long)size);
    return scratch;
  }
  struct region *r = tget(regions, mh);
  if (r == NULL) fail("replay: memory handle %#llx never registered", (unsigned long long)mh);
  if (data < r->base || data + size > r->base + r->size) fail("replay: buffer outside its region");
  return r->buf + (data - r->base);
}

/* Replays this rank's trace: the same calls in the same order, with this process's
 * objects; blocking points (connect/accept returning a comm, test returning done) wait
 * while polling every pending connect, as NCCL's setup and proxy loops do. The sizes
 * test reports must equal the recorded ones. */
static void replay(const char *path, const char *ifname, const char *bootstrap) {
  FILE *f = fopen(path, "r");
  if (f == NULL) fail("--replay %s: %s", path, strerror(errno));
  char **lines = NULL;
  int nlines = 0, cap = 0;
  char buf[2048];
  while (fgets(buf, sizeof buf, f)) {
    buf[strcspn(buf, "\n")] = 0;
    if (nlines == cap) {
      cap = cap ? 2 * cap : 1024;
      lines = realloc(lines, (size_t)cap * sizeof *lines);
      if (lines == NULL) fail("out of memory");
    }
    lines[nlines++] = strdup(buf);
  }
  fclose(f);

  CHECK(n_init());
  int ndev = 0;
  CHECK(n_devices(&ndev));
  replay_dev = -1;
  for (int d = 0; d < ndev && replay_dev < 0; d++) {
    struct props p;
    CHECK(n_props(d, &p));
    if (ifname == NULL || strcmp(p.name, ifname) == 0) replay_dev = d;
  }
  if (replay_dev < 0) fail("replay: no device %s", ifname ? ifname : "");

  /* every listen up front, the handles swapped in one go (NCCL's bootstrap carries them) */
  struct table lcs = {0}, comms = {0}, regions = {0}, reqs = {0}; /* comms: send and recv */
  uint32_t nl = 0;
  struct { uint32_t id; char h[NCCL_NET_HANDLE_MAXSIZE]; } *mine = NULL, *theirs = NULL;
  for (int i = 0; i < nlines; i++) {
    if (!strstr(lines[i], " listen dev=")) continue;
    mine = realloc(mine, (nl + 1) * sizeof *mine);
    memset(&mine[nl], 0, sizeof *mine);
    void *lc = NULL;
    CHECK(n_listen(replay_dev, mine[nl].h, &lc));
    mine[nl].id = (uint32_t)num_at(lines[i], " id=");
    tput(&lcs, mine[nl].id, lc); /* by id: a freed comm's address comes back later */
    nl++;
  }
  boot_open(bootstrap, 30);
  uint32_t their_n = 0;
  boot_xchg(&nl, &their_n, sizeof nl);
  theirs = calloc(their_n ? their_n : 1, sizeof *theirs);
  if (write(boot_fd, mine, nl * sizeof *mine) != (ssize_t)(nl * sizeof *mine)) fail("bootstrap write");
  for (size_t got = 0; got < their_n * sizeof *theirs;) {
    ssize_t n = read(boot_fd, (char *)theirs + got, their_n * sizeof *theirs - got);
    if (n <= 0) fail("bootstrap read: peer gone");
    got += (size_t)n;
  }

  long calls = 0, sends = 0, recvs = 0, tests = 0;
  int inits = 0;
  for (int i = 0; i < nlines; i++) {
    const char *l = lines[i];
    const char *call = strchr(l, ' ');
    call = call ? strchr(call + 1, ' ') : NULL;
    if (call == NULL) continue;
    call++;
    calls++;
    if (!strncmp(call, "init ", 5)) {
      if (inits++ > 0) CHECK(n_init());
    } else if (!strncmp(call, "devices", 7)) {
      int n = 0;
      CHECK(n_devices(&n));
    } else if (!strncmp(call, "getProperties", 13)) {
      struct props p;
      CHECK(n_props(replay_dev, &p));
    } else if (!strncmp(call, "listen ", 7)) {
      /* done up front */
    } else if (!strncmp(call, "connect ", 8) && strstr(call, "-> NULL")) {
      uint32_t id = (uint32_t)num_at(call, "listen_id=");
      pend = realloc(pend, (size_t)(npend + 1) * sizeof *pend);
      struct pending *p = &pend[npend++];
      memset(p, 0, sizeof *p);
      p->listen_id = id;
      uint32_t k = 0;
      while (k < their_n && theirs[k].id != id) k++;
      if (k == their_n) fail("replay: the peer's trace has no listen id %u", id);
      memcpy(p->handle, theirs[k].h, sizeof p->handle);
      CHECK(n_connect(replay_dev, p->handle, &p->sc));
    } else if (!strncmp(call, "connect ", 8)) {
      uint32_t id = (uint32_t)num_at(call, "listen_id=");
      struct pending *p = NULL;
      for (int k = 0; k < npend; k++)
        if (pend[k].listen_id == id) p = &pend[k];
      if (p == NULL) fail("replay: connect to %u completes before it started", id);
      for (double t0 = now_s(); p->sc == NULL; poll_connects())
        if (now_s() - t0 > 60) fail("replay line %d: connect not done in 60 s", i + 1);
      tput(&comms, num_at(call, "sendComm="), p->sc);
      p->listen_id = UINT32_MAX;
    } else if (!strncmp(call, "accept ", 7)) {
      void *lc = tget(&lcs, num_at(call, "listen_id=")), *rc = NULL;
      if (lc == NULL) fail("replay line %d: unknown listenComm", i + 1);
      for (double t0 = now_s(); rc == NULL; poll_connects()) {
        CHECK(n_accept(lc, &rc));
        if (now_s() - t0 > 60) fail("replay line %d: accept not done in 60 s", i + 1);
      }
      tput(&comms, num_at(call, "recvComm="), rc);
    } else if (!strncmp(call, "regMr ", 6)) {
      uint64_t comm = num_at(call, "comm="), size = num_at(call, "size=");
      int type = (int)num_at(call, "type=");
      void *c = tget(&comms, comm);
      if (c == NULL) fail("replay line %d: regMr on an unknown comm", i + 1);
      struct region *r = calloc(1, sizeof *r);
      r->base = num_at(call, "data=");
      r->size = size;
      r->buf = aligned_alloc(4096, (size + 4095) / 4096 * 4096 + 4096);
      if (r->buf == NULL) fail("out of memory");
      memset(r->buf, 0xa5, size);
      ncclResult_t res = n_reg(c, r->buf, size, type, &r->mh);
      if (strstr(call, "-> refused")) {
        if (res == ncclSuccess) fail("replay line %d: regMr type %d accepted, recorded refused", i + 1, type);
        free(r->buf);
        free(r);
      } else {
        CHECK(res);
        tput(&regions, num_at(call, "mhandle="), r);
      }
    } else if (!strncmp(call, "deregMr ", 8)) {
      uint64_t comm = num_at(call, "comm=");
      struct region *r = tget(&regions, num_at(call, "mhandle="));
      void *c = tget(&comms, comm);
      if (r == NULL || c == NULL) fail("replay line %d: deregMr of unknown objects", i + 1);
      CHECK(n_dereg(c, r->mh));
    } else if (!strncmp(call, "isend ", 6)) {
      uint64_t q = num_at(call, "request=");
      if (q == 0) continue; /* NCCL retried it later: that later call is its own line */
      void *sc = tget(&comms, num_at(call, "sendComm="));
      uint64_t size = num_at(call, "size=");
      struct region *r = tget(&regions, num_at(call, "mhandle="));
      void *data = ptr_in(&regions, num_at(call, "mhandle="), num_at(call, "data="), size);
      if (sc == NULL) fail("replay line %d: isend on an unknown comm", i + 1);
      tput(&reqs, q, post_send(sc, data, size, (int)(int64_t)num_at(call, "tag="), r ? r->mh : NULL));
      sends++;
    } else if (!strncmp(call, "irecv ", 6)) {
      uint64_t q = num_at(call, "-> request=");
      if (q == 0) continue;
      void *rc = tget(&comms, num_at(call, "recvComm="));
      if (rc == NULL) fail("replay line %d: irecv on an unknown comm", i + 1);
      uint64_t sz[MAX_GROUP], tg[MAX_GROUP], da[MAX_GROUP], mh[MAX_GROUP];
      int n = list_at(call, "sizes=", sz, MAX_GROUP);
      if (list_at(call, "tags=", tg, MAX_GROUP) != n || list_at(call, "datas=", da, MAX_GROUP) != n ||
          list_at(call, "mhandles=", mh, MAX_GROUP) != n)
        fail("replay line %d: irecv lists differ in length", i + 1);
      void *data[MAX_GROUP], *mhs[MAX_GROUP];
      size_t sizes[MAX_GROUP];
      int tags[MAX_GROUP];
      for (int k = 0; k < n; k++) {
        struct region *r = tget(&regions, mh[k]);
        data[k] = ptr_in(&regions, mh[k], da[k], sz[k]);
        mhs[k] = r ? r->mh : NULL;
        sizes[k] = sz[k];
        tags[k] = (int)(int64_t)tg[k];
      }
      tput(&reqs, q, post_recv(rc, n, data, sizes, tags, mhs));
      recvs++;
    } else if (!strncmp(call, "test ", 5)) {
      uint64_t q = num_at(call, "request=");
      void *req = tget(&reqs, q);
      if (req == NULL) fail("replay line %d: test of an unknown request", i + 1);
      uint64_t want[MAX_GROUP];
      int n = list_at(call, "sizes=", want, MAX_GROUP), got[MAX_GROUP], done = 0;
      for (double t0 = now_s(); !done;) {
        CHECK(n_test(req, &done, got));
        if (!done) {
          poll_connects();
          sched_yield();
          if (now_s() - t0 > 60) fail("replay line %d: request not done in 60 s", i + 1);
        }
      }
      for (int k = 0; k < n; k++)
        if ((uint64_t)got[k] != want[k])
          fail("replay line %d: test size[%d] %d, recorded %llu", i + 1, k, got[k], (unsigned long long)want[k]);
      tput(&reqs, q, NULL);
      tests++;
    } else if (!strncmp(call, "iflush ", 7)) {
      void *rc = tget(&comms, num_at(call, "recvComm=")), *req = NULL, *nomh = NULL;
      static uint8_t scratch[8];
      void *d = scratch;
      int zero = 0;
      CHECK(n_iflush(rc, 1, &d, &zero, &nomh, &req));
      if (req != NULL) wait_req(req, NULL, "iflush");
    } else if (!strncmp(call, "closeSend ", 10)) {
      CHECK(n_close_send(tget(&comms, num_at(call, "comm="))));
      tput(&comms, num_at(call, "comm="), NULL);
    } else if (!strncmp(call, "closeRecv ", 10)) {
      CHECK(n_close_recv(tget(&comms, num_at(call, "comm="))));
      tput(&comms, num_at(call, "comm="), NULL);
    } else if (!strncmp(call, "closeListen ", 12)) {
      CHECK(n_close_listen(tget(&lcs, num_at(call, " id="))));
    } else if (!strncmp(call, "finalize", 8)) {
      barrier(); /* the peer may still need our acknowledgements */
      if (V >= 12) CHECK(N12->finalize(ctx));
    } else {
      fail("replay line %d: unknown call: %s", i + 1, call);
    }
  }
  barrier();
  ok("replayed %s: %ld calls (%d listens, %ld isends, %ld irecvs, %ld completed tests, sizes as recorded)",
     path, calls, nl, sends, recvs, tests);
  printf("ALL OK rank %d v%d replay\n", rank, V);
}

/* One thread driving one comm pair, as NCCL's proxy threads do (one per GPU of a
 * process, on a shared device): `window` in flight, every byte checked. */
struct worker {
  void *sc, *rc, *smh, *rmh;
  uint8_t *sbuf, *rbuf;
  int me, peer, id;
  size_t size;
  uint32_t count;
};

static void *worker_run(void *arg) {
  struct worker *w = arg;
  enum { WIN = 4 };
  void *sreq[WIN], *rreq[WIN];
  for (uint32_t base = 0; base < w->count; base += WIN) {
    uint32_t n = w->count - base < WIN ? w->count - base : WIN;
    for (uint32_t k = 0; k < n; k++) {
      void *d = w->rbuf + k * w->size;
      size_t sz = w->size;
      int tag = 1;
      rreq[k] = post_recv(w->rc, 1, &d, &sz, &tag, &w->rmh);
      fill(w->sbuf + k * w->size, w->size, w->me, (uint32_t)(w->id * 100000 + base + k));
      sreq[k] = post_send(w->sc, w->sbuf + k * w->size, w->size, 1, w->smh);
    }
    for (uint32_t k = 0; k < n; k++) {
      wait_req(sreq[k], NULL, "thread isend");
      int got = wait_req(rreq[k], NULL, "thread irecv");
      if (got != (int)w->size) fail("thread %d: %d bytes", w->id, got);
      verify(w->rbuf + k * w->size, w->size, w->peer, (uint32_t)(w->id * 100000 + base + k), "thread");
    }
  }
  return NULL;
}

/* ---- the contract ------------------------------------------------------------------- */

int main(int argc, char **argv) {
  const char *plugin = getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN") : "metaroce";
  const char *bootstrap = NULL, *ifname = NULL, *replay_path = NULL;
  int version_given = 0;
  int timeout = 180;
  size_t bulk_size = 1 << 20, bulk_total = 256u << 20;
  int window = 8, one_way = 0;
  V = 12;
  rank = -1;
  static const struct option opts[] = {
      {"plugin", 1, 0, 'p'}, {"version", 1, 0, 'V'}, {"rank", 1, 0, 'r'},
      {"bootstrap", 1, 0, 'b'}, {"ifname", 1, 0, 'i'}, {"bulk-size", 1, 0, 's'},
      {"bulk-mib", 1, 0, 'm'}, {"window", 1, 0, 'w'}, {"timeout", 1, 0, 't'},
      {"one-way", 0, 0, 'o'}, {"replay", 1, 0, 'R'}, {"verbose", 0, 0, 'v'}, {0, 0, 0, 0}};
  for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
    switch (c) {
      case 'p': plugin = optarg; break;
      case 'V': V = atoi(optarg), version_given = 1; break;
      case 'R': replay_path = optarg; break;
      case 'r': rank = atoi(optarg); break;
      case 'b': bootstrap = optarg; break;
      case 'i': ifname = optarg; break;
      case 's': bulk_size = strtoull(optarg, NULL, 0); break;
      case 'm': bulk_total = strtoull(optarg, NULL, 0) << 20; break;
      case 'w': window = atoi(optarg); break;
      case 't': timeout = atoi(optarg); break;
      case 'o': one_way = 1; break;
      case 'v': verbose = 1; break;
      default: return 2;
    }
  }
  if ((rank != 0 && rank != 1) || bootstrap == NULL || V < 6 || V > 12 || window < 1 ||
      window > MAXREQ || bulk_size < 1 || bulk_size > (1u << 30)) {
    fprintf(stderr, "usage: %s --rank 0|1 --bootstrap IP:PORT [--version 6..12] [--ifname NAME]\n"
                    "  [--plugin NAME] [--bulk-size BYTES] [--bulk-mib MIB] [--window 1..32]\n"
                    "  [--one-way] [--replay TRACE] [--timeout S] [--verbose]\n", argv[0]);
    return 2;
  }
  signal(SIGALRM, SIG_DFL);
  /* a hang is a failure, not a stuck CI job; it says so, after the last step that held */
  alarm_len = (size_t)snprintf(alarm_msg, sizeof alarm_msg,
                               "FAIL rank %d: timed out after %d s (--timeout)\n", rank, timeout);
  if (alarm_len >= sizeof alarm_msg) alarm_len = sizeof alarm_msg - 1;
  signal(SIGALRM, on_alarm);
  alarm((unsigned)timeout);
  int me = rank, peer = 1 - rank;

  if (replay_path != NULL && !version_given) { /* the version the recorded NCCL loaded */
    FILE *f = fopen(replay_path, "r");
    char line[256];
    while (f && fgets(line, sizeof line, f)) {
      char *p = strstr(line, " init v");
      if (p) {
        V = atoi(p + 7);
        break;
      }
    }
    if (f) fclose(f);
  }
  /* load the way NCCL does: the name on the loader's path, then the versioned symbol */
  char lib[256];
  snprintf(lib, sizeof lib, "libnccl-net-%s.so", plugin);
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == NULL) fail("dlopen %s: %s", lib, dlerror());
  char sym[32];
  snprintf(sym, sizeof sym, "ncclNetPlugin_v%d", V);
  P = dlsym(h, sym);
  if (P == NULL) fail("%s has no %s", lib, sym);
  if (strcmp(N6->name, plugin) != 0) fail("%s names itself %s", sym, N6->name);
  ok("loaded %s from %s (pid %d)", sym, lib, (int)getpid());
  if (replay_path != NULL) {
    replay(replay_path, ifname, bootstrap);
    return 0;
  }

  CHECK(n_init());
  int ndev = 0;
  CHECK(n_devices(&ndev));
  if (ndev < 1) fail("devices: %d", ndev);
  int dev = -1;
  for (int d = 0; d < ndev; d++) {
    struct props p;
    CHECK(n_props(d, &p));
    if (p.name == NULL || !p.name[0]) fail("dev %d: no name", d);
    if (p.ptrSupport != NCCL_PTR_HOST) fail("dev %d: ptrSupport %#x, want HOST only", d, p.ptrSupport);
    if (p.speed <= 0 || p.maxComms < 1 || p.maxRecvs < 1 || p.maxRecvs > MAX_GROUP)
      fail("dev %d: speed %d maxComms %d maxRecvs %d", d, p.speed, p.maxComms, p.maxRecvs);
    char path[128];
    snprintf(path, sizeof path, "/sys/class/net/%s/speed", p.name);
    FILE *f = fopen(path, "r");
    int sys_speed = -1;
    if (f) {
      if (fscanf(f, "%d", &sys_speed) != 1) sys_speed = -1;
      fclose(f);
    }
    if (sys_speed > 0 && sys_speed != p.speed) fail("dev %d: speed %d, %s says %d", d, p.speed, path, sys_speed);
    if (V >= 7 && p.netDeviceType != NCCL_NET_DEVICE_HOST) fail("dev %d: netDeviceType %d", d, p.netDeviceType);
    if (V >= 9 && (p.vndevs != 1 || p.vdev0 != d || p.maxP2pBytes <= 0 || p.forceFlush != 0))
      fail("dev %d: vProps %d/%d maxP2pBytes %lld forceFlush %d", d, p.vndevs, p.vdev0, p.maxP2pBytes, p.forceFlush);
    if (V >= 12 && p.maxMultiRequestSize < 1) fail("dev %d: maxMultiRequestSize %d", d, p.maxMultiRequestSize);
    printf("RESULT {\"rank\": %d, \"version\": %d, \"dev\": %d, \"name\": \"%s\", \"pciPath\": \"%s\", "
           "\"speed\": %d, \"sys_speed\": %d, \"ptrSupport\": %d, \"maxComms\": %d, \"maxRecvs\": %d, "
           "\"latency\": %g, \"maxP2pBytes\": %lld}\n",
           me, V, d, p.name, p.pciPath ? p.pciPath : "", p.speed, sys_speed, p.ptrSupport,
           p.maxComms, p.maxRecvs, (double)p.latency, p.maxP2pBytes);
    if (dev < 0 && (ifname == NULL || strcmp(p.name, ifname) == 0)) dev = d;
  }
  if (dev < 0) fail("no device named %s among %d", ifname, ndev);
  struct props props;
  CHECK(n_props(dev, &props));
  int group = props.maxRecvs;
  ok("init, %d device(s), properties checked; using dev %d (%s, %d Mbit/s, maxRecvs %d)", ndev,
     dev, props.name, props.speed, group);

  /* listen, swap handles, connect and accept polled together like NCCL's setup loop */
  boot_open(bootstrap, 30);
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {0}, peer_handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL, *sc = NULL, *rc = NULL;
  CHECK(n_listen(dev, handle, &lc));
  if (lc == NULL) fail("listen: no comm");
  {
    char junk[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void *bad = NULL;
    if (n_connect(dev, junk, &bad) == ncclSuccess && bad != NULL) fail("connect to a zero handle gave a comm");
  }
  boot_xchg(handle, peer_handle, sizeof handle);
  long connect_polls = 0, accept_polls = 0;
  double t0 = now_s();
  while (sc == NULL || rc == NULL) {
    if (sc == NULL) {
      CHECK(n_connect(dev, peer_handle, &sc));
      connect_polls++;
    }
    if (rc == NULL) {
      CHECK(n_accept(lc, &rc));
      accept_polls++;
    }
    if (now_s() - t0 > 30) fail("connect/accept: not established in 30 s (sc %p rc %p)", sc, rc);
  }
  if (connect_polls < 2) fail("connect returned a comm on its first call: it blocked or skipped the handshake");
  ok("connected in %.1f ms: connect polled %ld times, accept %ld times", (now_s() - t0) * 1e3,
     connect_polls, accept_polls);

  /* memory: host registered; CUDA and dma-buf refused honestly */
  size_t big = bulk_size > (4u << 20) ? bulk_size : (4u << 20);
  size_t send_len = (size_t)window * big + (8u << 20), recv_len = send_len;
  uint8_t *sbuf = aligned_alloc(4096, send_len), *rbuf = aligned_alloc(4096, recv_len);
  if (!sbuf || !rbuf) fail("out of memory");
  memset(rbuf, 0, recv_len);
  void *smh = NULL, *rmh = NULL, *cuda = NULL;
  CHECK(n_reg(sc, sbuf, send_len, NCCL_PTR_HOST, &smh));
  CHECK(n_reg(rc, rbuf, recv_len, NCCL_PTR_HOST, &rmh));
  if (n_reg(sc, sbuf, 4096, NCCL_PTR_CUDA, &cuda) == ncclSuccess) fail("regMr accepted NCCL_PTR_CUDA");
  if (n_reg_dmabuf(sc, sbuf, 4096, &cuda) == ncclSuccess) fail("regMrDmaBuf accepted a dma-buf");
  ok("regMr: host memory registered, CUDA and dma-buf refused");

  /* 32 in flight each way; receives larger than the sends; one zero-byte message */
  {
    const size_t slot = 64 * 1024;
    void *sreq[MAXREQ], *rreq[MAXREQ];
    size_t ssz[MAXREQ];
    for (int i = 0; i < MAXREQ; i++) {
      ssz[i] = i == 5 ? 0 : (size_t)(1000 + i * 1999) % slot;
      void *d = rbuf + (size_t)i * slot;
      size_t sz = slot;
      int tag = i % 4;
      rreq[i] = post_recv(rc, 1, &d, &sz, &tag, &rmh);
    }
    for (int i = 0; i < MAXREQ; i++) {
      uint8_t *d = sbuf + (size_t)i * slot;
      fill(d, ssz[i], me, (uint32_t)i);
      sreq[i] = post_send(sc, d, ssz[i], i % 4, smh);
    }
    void *extra = (void *)0x1;
    CHECK(n_isend(sc, sbuf, 16, 0, smh, &extra));
    if (extra != NULL) fail("a 33rd isend on one comm got a request (NCCL_NET_MAX_REQUESTS is 32)");
    extra = (void *)0x1;
    {
      void *d = rbuf + (size_t)MAXREQ * slot;
      size_t sz = 16;
      int tag = 0;
      CHECK(n_irecv(rc, 1, &d, &sz, &tag, &rmh, &extra));
      if (extra != NULL && extra != (void *)NCCL_NET_OPTIONAL_RECV_COMPLETION)
        fail("a 33rd irecv on one comm got a request");
    }
    for (int i = 0; i < MAXREQ; i++) {
      int got = wait_req(sreq[i], NULL, "isend");
      if (got != (int)ssz[i]) fail("isend %d: test says %d bytes, sent %zu", i, got, ssz[i]);
    }
    for (int i = 0; i < MAXREQ; i++) {
      size_t want = i == 5 ? 0 : (size_t)(1000 + i * 1999) % slot; /* the peer's sizes are ours */
      int got = wait_req(rreq[i], NULL, "irecv");
      if (got != (int)want) fail("irecv %d: test says %d bytes, the peer sent %zu into %zu", i, got, want, slot);
      verify(rbuf + (size_t)i * slot, want, peer, (uint32_t)i, "window");
    }
    ok("%d isends and %d irecvs in flight per comm, the 33rd refused with request NULL; "
       "receives larger than their sends report the real size; a zero-byte message", MAXREQ, MAXREQ);
  }

  /* grouped receives: 4 groups of maxRecvs buffers in flight, tags sent in reverse order */
  {
    enum { GROUPS = 4 };
    const size_t slot = 128 * 1024;
    void *greq[GROUPS];
    int tags[MAX_GROUP];
    for (int j = 0; j < group; j++) tags[j] = 100 + j;
    for (int g = 0; g < GROUPS; g++) {
      void *d[MAX_GROUP];
      size_t sz[MAX_GROUP];
      for (int j = 0; j < group; j++) d[j] = rbuf + ((size_t)g * MAX_GROUP + j) * slot, sz[j] = slot;
      greq[g] = post_recv(rc, group, d, sz, tags, (void **)(void *[]){rmh, rmh, rmh, rmh, rmh, rmh, rmh, rmh});
    }
    void *sreq[GROUPS * MAX_GROUP];
    int ns = 0;
    for (int g = 0; g < GROUPS; g++) {
      for (int j = group - 1; j >= 0; j--) {
        uint32_t msg = (uint32_t)(1000 + g * MAX_GROUP + j);
        size_t len = 3000 + (size_t)j * 5003 + (size_t)g * 17;
        uint8_t *d = sbuf + ((size_t)g * MAX_GROUP + j) * slot;
        fill(d, len, me, msg);
        sreq[ns++] = post_send(sc, d, len, tags[j], smh);
      }
    }
    for (int i = 0; i < ns; i++) wait_req(sreq[i], NULL, "grouped isend");
    for (int g = 0; g < GROUPS; g++) {
      int sizes[MAX_GROUP];
      wait_req(greq[g], sizes, "grouped irecv");
      for (int j = 0; j < group; j++) {
        size_t want = 3000 + (size_t)j * 5003 + (size_t)g * 17;
        if (sizes[j] != (int)want) fail("group %d buffer %d (tag %d): %d bytes, want %zu", g, j, tags[j], sizes[j], want);
        verify(rbuf + ((size_t)g * MAX_GROUP + j) * slot, want, peer, (uint32_t)(1000 + g * MAX_GROUP + j), "group");
      }
    }
    ok("grouped receives: %d groups of %d buffers in flight, tags matched within each group", GROUPS, group);
  }

  /* sends that arrive before their receive is posted (NCCL's LL protocols do this):
   * post the sends, let them land, only then post the receives */
  {
    enum { EARLY = 4 };
    static const size_t early_len[EARLY] = {1, 1024, 200000, 3u << 20};
    const size_t slot = 4u << 20;
    void *sreq[EARLY], *rreq[EARLY];
    for (int i = 0; i < EARLY; i++) {
      uint8_t *d = sbuf + (size_t)i * slot;
      fill(d, early_len[i], me, (uint32_t)(2000 + i));
      sreq[i] = post_send(sc, d, early_len[i], 20 + i, smh);
    }
    barrier();
    usleep(100000);
    for (int i = 0; i < EARLY; i++) {
      void *d = rbuf + (size_t)i * slot;
      size_t sz = slot;
      int tag = 20 + i;
      rreq[i] = post_recv(rc, 1, &d, &sz, &tag, &rmh);
    }
    for (int i = 0; i < EARLY; i++) wait_req(sreq[i], NULL, "early isend");
    for (int i = 0; i < EARLY; i++) {
      int got = wait_req(rreq[i], NULL, "late irecv");
      if (got != (int)early_len[i]) fail("late irecv %d: %d bytes, want %zu", i, got, early_len[i]);
      verify(rbuf + (size_t)i * slot, early_len[i], peer, (uint32_t)(2000 + i), "late receive");
    }
    ok("sends of 1 B to 3 MiB that arrived before their receives were posted");
  }

  /* several comm pairs on one device at once (NCCL opens one per channel and peer): the
   * same tags on every comm, sent in reverse comm order; nothing crosses over */
  {
    enum { K = 4 };
    char hs[K][NCCL_NET_HANDLE_MAXSIZE], phs[K][NCCL_NET_HANDLE_MAXSIZE];
    void *lcs[K], *scs[K] = {0}, *rcs[K] = {0}, *smhs[K], *rmhs[K], *sreq[K], *rreq[K];
    const size_t slot = 256 * 1024;
    memset(hs, 0, sizeof hs);
    for (int k = 0; k < K; k++) CHECK(n_listen(dev, hs[k], &lcs[k]));
    boot_xchg(hs, phs, sizeof hs);
    double t1 = now_s();
    for (int left = 2 * K; left > 0;) {
      left = 0;
      for (int k = 0; k < K; k++) {
        if (scs[k] == NULL) CHECK(n_connect(dev, phs[k], &scs[k]));
        if (rcs[k] == NULL) CHECK(n_accept(lcs[k], &rcs[k]));
        left += (scs[k] == NULL) + (rcs[k] == NULL);
      }
      if (now_s() - t1 > 30) fail("%d more comms: not established in 30 s", K);
    }
    for (int k = 0; k < K; k++) {
      CHECK(n_reg(scs[k], sbuf, send_len, NCCL_PTR_HOST, &smhs[k]));
      CHECK(n_reg(rcs[k], rbuf, recv_len, NCCL_PTR_HOST, &rmhs[k]));
      void *d = rbuf + (size_t)k * slot;
      size_t sz = slot;
      int tag = 0;
      rreq[k] = post_recv(rcs[k], 1, &d, &sz, &tag, &rmhs[k]);
    }
    for (int k = K - 1; k >= 0; k--) {
      uint8_t *d = sbuf + (size_t)k * slot;
      fill(d, 5000 + (size_t)k * 1000, me, (uint32_t)(3000 + k));
      sreq[k] = post_send(scs[k], d, 5000 + (size_t)k * 1000, 0, smhs[k]);
    }
    for (int k = 0; k < K; k++) {
      wait_req(sreq[k], NULL, "multi-comm isend");
      int got = wait_req(rreq[k], NULL, "multi-comm irecv");
      if (got != 5000 + k * 1000) fail("comm %d received %d bytes: another comm's message", k, got);
      verify(rbuf + (size_t)k * slot, (size_t)got, peer, (uint32_t)(3000 + k), "multi-comm");
    }
    barrier();
    for (int k = 0; k < K; k++) {
      CHECK(n_dereg(scs[k], smhs[k]));
      CHECK(n_dereg(rcs[k], rmhs[k]));
      CHECK(n_close_send(scs[k]));
      CHECK(n_close_recv(rcs[k]));
      CHECK(n_close_listen(lcs[k]));
    }
    ok("%d more comm pairs on one device: same tags, no message crossed comms; closed", K);
  }

  /* two threads at once, each on its own comm pair of the same device */
  {
    enum { T = 2 };
    char hs[T][NCCL_NET_HANDLE_MAXSIZE], phs[T][NCCL_NET_HANDLE_MAXSIZE];
    void *lcs[T];
    struct worker w[T];
    memset(hs, 0, sizeof hs);
    memset(w, 0, sizeof w);
    for (int k = 0; k < T; k++) CHECK(n_listen(dev, hs[k], &lcs[k]));
    boot_xchg(hs, phs, sizeof hs);
    double t1 = now_s();
    for (int left = 2 * T; left > 0;) {
      left = 0;
      for (int k = 0; k < T; k++) {
        if (w[k].sc == NULL) CHECK(n_connect(dev, phs[k], &w[k].sc));
        if (w[k].rc == NULL) CHECK(n_accept(lcs[k], &w[k].rc));
        left += (w[k].sc == NULL) + (w[k].rc == NULL);
      }
      if (now_s() - t1 > 30) fail("thread comms: not established in 30 s");
    }
    pthread_t th[T];
    /* 32 messages each, fewer when --bulk-mib asks for a light run (the agent's self-test
     * on a slow node): at least 4, so the window of 4 still fills */
    size_t per = bulk_total / (T * (256u << 10));
    uint32_t count = per > 32 ? 32 : per < 4 ? 4 : (uint32_t)per;
    for (int k = 0; k < T; k++) {
      w[k].id = k, w[k].me = me, w[k].peer = peer, w[k].size = 256 * 1024, w[k].count = count;
      w[k].sbuf = sbuf + (size_t)k * (4u << 20);
      w[k].rbuf = rbuf + (size_t)k * (4u << 20);
      CHECK(n_reg(w[k].sc, w[k].sbuf, 4u << 20, NCCL_PTR_HOST, &w[k].smh));
      CHECK(n_reg(w[k].rc, w[k].rbuf, 4u << 20, NCCL_PTR_HOST, &w[k].rmh));
      if (pthread_create(&th[k], NULL, worker_run, &w[k]) != 0) fail("pthread_create");
    }
    for (int k = 0; k < T; k++) pthread_join(th[k], NULL);
    barrier();
    for (int k = 0; k < T; k++) {
      CHECK(n_dereg(w[k].sc, w[k].smh));
      CHECK(n_dereg(w[k].rc, w[k].rmh));
      CHECK(n_close_send(w[k].sc));
      CHECK(n_close_recv(w[k].rc));
      CHECK(n_close_listen(lcs[k]));
    }
    ok("%d threads at once, each with its own comm pair on the device: %u x 256 KiB each way, checked", T,
       count);
  }

  /* a receive much larger than its send, then iflush (host memory: nothing to flush) */
  {
    void *d = rbuf;
    size_t sz = 4u << 20;
    int tag = 7, got;
    void *rreq = post_recv(rc, 1, &d, &sz, &tag, &rmh);
    fill(sbuf, 12345, me, 4242);
    void *sreq = post_send(sc, sbuf, 12345, 7, smh);
    wait_req(sreq, NULL, "isend 12345");
    got = wait_req(rreq, NULL, "irecv 4 MiB");
    if (got != 12345) fail("4 MiB receive of a 12345-byte send: test says %d", got);
    verify(rbuf, 12345, peer, 4242, "oversized receive");
    int isz = got;
    void *freq = (void *)0x1;
    CHECK(n_iflush(rc, 1, &d, &isz, &rmh, &freq));
    if (freq != NULL) wait_req(freq, NULL, "iflush");
    ok("a 4 MiB receive of a 12345-byte send reports 12345; iflush completes");
  }

  /* bulk: both directions at once (--one-way: rank 1 to rank 0), `window` in flight,
   * every byte checked */
  double goodput_mbps = 0, seconds = 0;
  {
    uint32_t count = (uint32_t)(bulk_total / bulk_size);
    if (count < 1) count = 1;
    uint32_t nsend = one_way && me == 0 ? 0 : count, nrecv = one_way && me == 1 ? 0 : count;
    uint8_t *expect = malloc((size_t)window * bulk_size);
    if (!expect) fail("out of memory");
    for (int w = 0; w < window; w++) {
      fill(sbuf + (size_t)w * bulk_size, bulk_size, me, (uint32_t)(50000 + w));
      fill(expect + (size_t)w * bulk_size, bulk_size, peer, (uint32_t)(50000 + w));
    }
    void *sreq[MAXREQ] = {0}, *rreq[MAXREQ] = {0};
    uint32_t sent = 0, sdone = 0, rposted = 0, rdone = 0;
    barrier();
    double start = now_s();
    while (sdone < nsend || rdone < nrecv) {
      while (rposted < nrecv && rposted - rdone < (uint32_t)window) {
        int w = (int)(rposted % (uint32_t)window);
        void *d = rbuf + (size_t)w * bulk_size;
        size_t sz = bulk_size;
        int tag = 9;
        rreq[w] = post_recv(rc, 1, &d, &sz, &tag, &rmh);
        rposted++;
      }
      while (sent < nsend && sent - sdone < (uint32_t)window) {
        int w = (int)(sent % (uint32_t)window);
        sreq[w] = post_send(sc, sbuf + (size_t)w * bulk_size, bulk_size, 9, smh);
        sent++;
      }
      int done = 0, size = 0, progressed = 0;
      if (sdone < sent) {
        int w = (int)(sdone % (uint32_t)window);
        CHECK(n_test(sreq[w], &done, &size));
        if (done) sdone++, progressed = 1;
      }
      if (rdone < rposted) {
        int w = (int)(rdone % (uint32_t)window);
        CHECK(n_test(rreq[w], &done, &size));
        if (done) {
          if (size != (int)bulk_size) fail("bulk message %u: %d bytes", rdone, size);
          if (memcmp(rbuf + (size_t)w * bulk_size, expect + (size_t)w * bulk_size, bulk_size) != 0)
            verify(rbuf + (size_t)w * bulk_size, bulk_size, peer, (uint32_t)(50000 + w), "bulk");
          memset(rbuf + (size_t)w * bulk_size, 0, 64); /* a stale buffer would fail next time */
          rdone++;
          progressed = 1;
        }
      }
      if (!progressed) sched_yield(); /* like NCCL's idle proxy thread */
    }
    seconds = now_s() - start;
    free(expect);
    if (nrecv > 0) {
      goodput_mbps = (double)nrecv * (double)bulk_size * 8 / seconds / 1e6;
      printf("RESULT {\"rank\": %d, \"version\": %d, \"bulk_messages\": %u, \"bulk_size\": %zu, "
             "\"window\": %d, \"one_way\": %d, \"seconds\": %.3f, \"goodput_mbps\": %.1f}\n",
             me, V, nrecv, bulk_size, window, one_way, seconds, goodput_mbps);
    }
    ok("bulk: %u messages of %zu bytes %s, %d in flight: %.1f Mbit/s received", count, bulk_size,
       one_way ? "from rank 1 to rank 0" : "each way", window, goodput_mbps);
  }

  /* teardown in NCCL's order: after both sides finished, deregister, close, finalize */
  barrier();
  CHECK(n_dereg(sc, smh));
  CHECK(n_dereg(rc, rmh));
  CHECK(n_close_send(sc));
  CHECK(n_close_recv(rc));
  CHECK(n_close_listen(lc));
  if (V >= 12) CHECK(N12->finalize(ctx));
  barrier();
  ok("closeSend, closeRecv, closeListen, deregMr%s", V >= 12 ? ", finalize" : "");
  close(boot_fd);
  free(sbuf);
  free(rbuf);
  printf("ALL OK rank %d v%d\n", me, V);
  return 0;
}
