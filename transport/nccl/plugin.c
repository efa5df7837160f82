/*
 * libnccl-net-metaroce.so: NCCL's net plugin on the MetaRoCE transport's C ABI
 * (include/metaroce.h), one self-contained object with libmetaroce.a linked in.
 *
 * Model (net_v12 semantics; adapters.c maps v6..v11 onto it):
 * - A device is a netdev with an IP address (MR_NCCL_IFNAME selects, NCCL_SOCKET_IFNAME
 *   syntax). Each device has one transport endpoint (mr_ep: its UDP sockets and a
 *   progress thread), opened on the first listen/connect and shared by every comm of the
 *   process on that device; the comms are told apart by tag bits, so NCCL's many
 *   channels cost no extra threads or sockets.
 * - Connection setup is a two-message handshake on the endpoint, never blocking:
 *   connect sends HELLO{its send id, its address} to the listener's tag and returns
 *   sendComm NULL until WELCOME arrives; accept returns recvComm NULL until a HELLO has
 *   arrived, then answers WELCOME. The handle carries the listener's address and id.
 * - Data: a send of comm id S with NCCL tag T carries transport tag (S << 32 | T); the
 *   receive side posts one transport receive per buffer of a group with that tag,
 *   filtered by the sender's peer handle. The transport matches in send order, so
 *   NCCL's "the i-th send with tag T goes to the i-th posted receive with tag T" holds,
 *   and tags inside a group pick the buffer. A receive larger than its send completes
 *   with the real length (test() returns it).
 * - Every transport operation's context is an mrn_op; completions are drained from the
 *   endpoint's queue by whichever call comes first (test, connect, accept, close)
 *   under the device's lock and marked on their op.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "mrnccl.h"

/* ---- logging ------------------------------------------------------------------ */

static ncclDebugLogger_t logger;

void mrn_log(ncclDebugLogLevel level, const char *file, int line, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (logger != NULL)
    logger(level, NCCL_NET | NCCL_INIT, file, line, "NET/metaroce: %s", msg);
  else if (level == NCCL_LOG_WARN || getenv("MR_NCCL_DEBUG") != NULL)
    fprintf(stderr, "NET/metaroce %s: %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

/* ---- the call trace (MR_NCCL_TRACE) ------------------------------------------ */

static int trace_fd = -1;
static pthread_once_t trace_once = PTHREAD_ONCE_INIT;

static void trace_open(void) {
  const char *prefix = getenv("MR_NCCL_TRACE");
  if (prefix == NULL || !*prefix) return;
  char path[512];
  snprintf(path, sizeof path, "%s.%d", prefix, (int)getpid());
  trace_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (trace_fd < 0) WARN("MR_NCCL_TRACE: cannot open %s: %s", path, strerror(errno));
}

int mrn_tracing(void) {
  pthread_once(&trace_once, trace_open);
  return trace_fd >= 0;
}

/* One line per call: seconds (monotonic), thread id, the call and its arguments and
 * results; a single write(2) each, so threads never interleave inside a line. */
void mrn_trace(const char *fmt, ...) {
  char line[1024];
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  int n = snprintf(line, sizeof line, "%ld.%06ld %ld ", (long)t.tv_sec, t.tv_nsec / 1000,
                   (long)syscall(SYS_gettid));
  va_list ap;
  va_start(ap, fmt);
  n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
  va_end(ap);
  if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
  line[n++] = '\n';
  if (write(trace_fd, line, (size_t)n) < 0) { /* tracing is best effort */
  }
}

/* "[a,b,c]" of n numbers, for the trace. */
static const char *list_of(char *buf, size_t len, int n, const long long *v) {
  size_t at = 0;
  buf[at++] = '[';
  for (int i = 0; i < n && at + 24 < len; i++)
    at += (size_t)snprintf(buf + at, len - at, "%s%lld", i ? "," : "", v[i]);
  snprintf(buf + at, len - at, "]");
  return buf;
}

static void warn_transport(const char *what, int rc) {
  char detail[256];
  detail[0] = 0;
  mr_last_error(detail, sizeof detail);
  WARN("%s: %s (%d)%s%s", what, mr_strerror(rc), rc, detail[0] ? ": " : "", detail);
}

/* ---- devices ------------------------------------------------------------------ */

static struct mrn_dev devs[MRN_MAX_DEVS];
static int ndevs = -1;
static int init_refs;
static pthread_mutex_t global_lock = PTHREAD_MUTEX_INITIALIZER;

/* NCCL_SOCKET_IFNAME syntax: "^a,b" excludes, "=a,b" matches exactly, "a,b" by prefix. */
int mrn_ifname_selected(const char *spec, const char *name) {
  int exclude = 0, exact = 0;
  if (*spec == '^') exclude = 1, spec++;
  if (*spec == '=') exact = 1, spec++;
  int hit = 0;
  char buf[256];
  snprintf(buf, sizeof buf, "%s", spec);
  for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
    if (exact ? strcmp(name, tok) == 0 : strncmp(name, tok, strlen(tok)) == 0) {
      hit = 1;
      break;
    }
  }
  return exclude ? !hit : hit;
}

static int read_speed_mbps(const char *ifname) {
  char path[128];
  snprintf(path, sizeof path, "/sys/class/net/%s/speed", ifname);
  FILE *f = fopen(path, "r");
  int speed = -1;
  if (f != NULL) {
    if (fscanf(f, "%d", &speed) != 1) speed = -1;
    fclose(f);
  }
  /* unknown (-1, virtual links, EINVAL while down): NCCL's socket plugin's default */
  return speed > 0 ? speed : MRN_DEFAULT_SPEED_MBPS;
}

static char *read_pci_path(const char *ifname) {
  char path[128];
  snprintf(path, sizeof path, "/sys/class/net/%s/device", ifname);
  return realpath(path, NULL); /* NULL for virtual netdevs: NCCL places them at the CPU */
}

static int have_dev(const char *name) {
  for (int i = 0; i < ndevs; i++)
    if (strcmp(devs[i].name, name) == 0) return 1;
  return 0;
}

/* One device per selected netdev, with its first IPv4 address (else a global IPv6 one). */
static void discover(void) {
  const char *spec = getenv("MR_NCCL_IFNAME");
  struct ifaddrs *ifs = NULL;
  ndevs = 0;
  if (getifaddrs(&ifs) != 0) {
    WARN("getifaddrs: %s", strerror(errno));
    return;
  }
  for (int want_lo = 0; want_lo <= 1 && ndevs == 0; want_lo++) {
    for (int family_pass = 0; family_pass < 2; family_pass++) {
      int family = family_pass == 0 ? AF_INET : AF_INET6;
      for (struct ifaddrs *ifa = ifs; ifa != NULL && ndevs < MRN_MAX_DEVS; ifa = ifa->ifa_next) {
        if (ifa->ifa_addr == NULL || ifa->ifa_addr->sa_family != family) continue;
        if (!(ifa->ifa_flags & IFF_UP)) continue;
        int is_lo = (ifa->ifa_flags & IFF_LOOPBACK) != 0;
        if (spec != NULL && *spec) {
          if (!mrn_ifname_selected(spec, ifa->ifa_name)) continue;
        } else if (is_lo != want_lo || strncmp(ifa->ifa_name, "docker", 6) == 0) {
          continue;
        }
        if (strlen(ifa->ifa_name) >= sizeof devs[0].name || have_dev(ifa->ifa_name)) continue;
        char ip[INET6_ADDRSTRLEN];
        if (family == AF_INET) {
          inet_ntop(AF_INET, &((struct sockaddr_in *)ifa->ifa_addr)->sin_addr, ip, sizeof ip);
        } else {
          struct in6_addr *a6 = &((struct sockaddr_in6 *)ifa->ifa_addr)->sin6_addr;
          if (IN6_IS_ADDR_LINKLOCAL(a6)) continue;
          inet_ntop(AF_INET6, a6, ip, sizeof ip);
        }
        struct mrn_dev *d = &devs[ndevs];
        memset(d, 0, sizeof *d);
        snprintf(d->name, sizeof d->name, "%s", ifa->ifa_name);
        snprintf(d->ip, sizeof d->ip, "%s", ip);
        d->speed_mbps = read_speed_mbps(d->name);
        d->pci_path = read_pci_path(d->name);
        d->ifindex = if_nametoindex(d->name);
        d->next_id = 1;
        pthread_mutex_init(&d->lock, NULL);
        INFO("device %d: %s %s speed %d Mbit/s%s%s", ndevs, d->name, d->ip, d->speed_mbps,
             d->pci_path ? " pci " : "", d->pci_path ? d->pci_path : "");
        ndevs++;
      }
    }
    if (spec != NULL && *spec) break; /* an explicit selection never falls back to lo */
  }
  freeifaddrs(ifs);
  if (ndevs == 0)
    WARN("no usable netdev (up, with an IP address)%s%s", spec ? " matching MR_NCCL_IFNAME=" : "",
         spec ? spec : "");
}

ncclResult_t mrn_init(ncclDebugLogger_t log, int version) {
  TRACE("init v%d", version);
  pthread_mutex_lock(&global_lock);
  if (log != NULL) logger = log;
  if (mr_abi_version() != MR_ABI_VERSION) {
    pthread_mutex_unlock(&global_lock);
    WARN("transport ABI %u, plugin built for %u", mr_abi_version(), MR_ABI_VERSION);
    return ncclInternalError;
  }
  if (ndevs < 0) discover();
  init_refs++;
  pthread_mutex_unlock(&global_lock);
  return ncclSuccess;
}

/* v12 finalize: endpoints close once no NCCL communicator holds the plugin and no comm
 * of ours is open on them (older NCCL never finalizes: the process exit does). */
ncclResult_t mrn_finalize(void) {
  TRACE("finalize");
  pthread_mutex_lock(&global_lock);
  if (init_refs > 0 && --init_refs == 0) {
    for (int i = 0; i < ndevs; i++) {
      struct mrn_dev *d = &devs[i];
      pthread_mutex_lock(&d->lock);
      if (d->ep != NULL && d->ncomms == 0) {
        mr_ep_close(d->ep);
        d->ep = NULL;
      }
      pthread_mutex_unlock(&d->lock);
    }
  }
  pthread_mutex_unlock(&global_lock);
  return ncclSuccess;
}

ncclResult_t mrn_devices(int *n) {
  if (n == NULL) return ncclInvalidArgument;
  *n = ndevs < 0 ? 0 : ndevs;
  TRACE("devices -> %d", *n);
  return ncclSuccess;
}

static struct mrn_dev *dev_at(int dev) {
  if (ndevs < 0 || dev < 0 || dev >= ndevs) {
    WARN("device %d: out of range 0..%d (init first)", dev, ndevs - 1);
    return NULL;
  }
  return &devs[dev];
}

ncclResult_t mrn_get_properties(int dev, struct mrn_props *p) {
  struct mrn_dev *d = dev_at(dev);
  if (d == NULL || p == NULL) return ncclInvalidArgument;
  memset(p, 0, sizeof *p);
  p->name = d->name;
  p->pciPath = d->pci_path;
  p->guid = ((uint64_t)d->ifindex << 8) | (uint64_t)dev;
  p->ptrSupport = NCCL_PTR_HOST; /* host memory only: no GPUDirect, no dma-buf */
  p->speed = d->speed_mbps;
  p->port = 0;
  p->latency = 0;
  p->maxComms = MRN_MAX_COMMS;
  p->maxRecvs = MRN_MAX_RECVS;
  uint64_t max_msg = mr_max_msg_size();
  p->maxP2pBytes = max_msg < (uint64_t)NCCL_MAX_NET_SIZE_BYTES ? max_msg : NCCL_MAX_NET_SIZE_BYTES;
  p->maxCollBytes = p->maxP2pBytes;
  TRACE("getProperties dev=%d -> name=%s speed=%d ptrSupport=%d maxRecvs=%d", dev, p->name,
        p->speed, p->ptrSupport, p->maxRecvs);
  return ncclSuccess;
}

/* Open the device's endpoint on first use. Caller holds d->lock. */
static int dev_ep(struct mrn_dev *d) {
  if (d->ep != NULL) return 0;
  char config[128];
  snprintf(config, sizeof config, "addr=%s", d->ip);
  int rc = mr_ep_open(config, &d->ep);
  if (rc != 0) {
    d->ep = NULL;
    warn_transport("mr_ep_open", rc);
    return rc;
  }
  d->self_len = sizeof d->self;
  rc = mr_ep_name(d->ep, d->self, &d->self_len);
  if (rc != 0) {
    warn_transport("mr_ep_name", rc);
    mr_ep_close(d->ep);
    d->ep = NULL;
    return rc;
  }
  char name[96];
  mr_addr_format(d->self, d->self_len, name, sizeof name);
  INFO("device %s: endpoint %s", d->name, name);
  return 0;
}

/* Drain the completion queue onto the ops. Caller holds d->lock. NCCL's proxy
 * thread calls this in a spin: mr_progress lets it receive and acknowledge
 * itself (never waiting for the transport's progress thread, which a spinning
 * thread on a busy core would hold off for a time slice). */
static int progress(struct mrn_dev *d) {
  struct mr_completion c[64];
  int pending = mr_progress(d->ep);
  if (pending < 0 && pending != -MR_EAGAIN) {
    warn_transport("mr_progress", pending);
    return pending;
  }
  for (;;) {
    int n = mr_poll(d->ep, c, 64);
    if (n < 0) {
      if (n == -MR_EAGAIN) return 0;
      warn_transport("mr_poll", n);
      return n;
    }
    for (int i = 0; i < n; i++) {
      struct mrn_op *op = c[i].context;
      if (op == NULL) continue;
      op->err = c[i].err;
      op->len = c[i].len;
      op->olen = c[i].olen;
      op->peer = c[i].peer;
      op->done = 1;
      if (op->req != NULL) op->req->ndone++;
    }
    if (n < 64) return 0;
  }
}

static ncclResult_t result_of(int err) {
  switch (-err) {
    case MR_ETIMEDOUT:
    case MR_ECONNRESET:
      return ncclRemoteError;
    case MR_EINVAL:
    case MR_ETRUNC:
      return ncclInvalidUsage;
    default:
      return ncclSystemError;
  }
}

/* ---- comms -------------------------------------------------------------------- */

static struct mrn_comm *comm_new(struct mrn_dev *d, int kind) {
  struct mrn_comm *c = calloc(1, sizeof *c);
  if (c == NULL) return NULL;
  c->magic = MRN_COMM_MAGIC;
  c->kind = kind;
  c->dev = d;
  c->id = d->next_id++ & MRN_ID_MASK;
  if (c->id == 0) c->id = d->next_id++ & MRN_ID_MASK;
  for (int i = 0; i < MRN_MAX_REQS; i++) {
    c->reqs[i].comm = c;
    for (int j = 0; j < MRN_MAX_RECVS; j++) c->reqs[i].ops[j].req = &c->reqs[i];
  }
  d->ncomms++;
  return c;
}

static struct mrn_comm *comm_of(void *p, int kind) {
  struct mrn_comm *c = p;
  if (c == NULL || c->magic != MRN_COMM_MAGIC || (kind && c->kind != kind)) return NULL;
  return c;
}

/* Wait (bounded) until pred(c) holds, progressing the endpoint; the lock is dropped while
 * waiting. Returns 1 if it held. */
static int wait_until(struct mrn_comm *c, int (*pred)(struct mrn_comm *), int timeout_ms) {
  struct mrn_dev *d = c->dev;
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    if (progress(d) != 0) return pred(c);
    if (pred(c)) return 1;
    clock_gettime(CLOCK_MONOTONIC, &t);
    long ms = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
    if (ms > timeout_ms) return 0;
    pthread_mutex_unlock(&d->lock);
    mr_wait(d->ep, 10);
    pthread_mutex_lock(&d->lock);
  }
}

static int hs_idle(struct mrn_comm *c) {
  return (!c->hs_posted || c->hs_op.done) && (!c->tx_posted || c->tx_op.done);
}

static int reqs_idle(struct mrn_comm *c) {
  for (int i = 0; i < MRN_MAX_REQS; i++) {
    struct mrn_req *r = &c->reqs[i];
    if (r->used && r->ndone < r->n) return 0;
  }
  return 1;
}

static int all_idle(struct mrn_comm *c) { return hs_idle(c) && reqs_idle(c); }

/* Free a comm whose operations are all finished; one with operations still posted is
 * kept (their contexts point into it), so a later completion never touches freed memory. */
static void comm_free(struct mrn_comm *c) {
  struct mrn_dev *d = c->dev;
  if (!all_idle(c)) {
    WARN("comm %u: operations still posted at close; keeping its memory", c->id);
    return;
  }
  c->magic = 0;
  d->ncomms--;
  free(c);
}

static int post_hello_recv(struct mrn_comm *l) {
  memset(&l->hs_op, 0, sizeof l->hs_op);
  int rc = mr_recv(l->dev->ep, MR_ANY_PEER, &l->hello, sizeof l->hello, MRN_TAG_HELLO | l->id, 0,
                   MR_TAGGED, &l->hs_op);
  l->hs_posted = rc == 0;
  if (rc != 0) warn_transport("mr_recv (listen)", rc);
  return rc;
}

ncclResult_t mrn_listen(int dev, void *handle, void **listen_comm) {
  struct mrn_dev *d = dev_at(dev);
  if (d == NULL || handle == NULL || listen_comm == NULL) return ncclInvalidArgument;
  _Static_assert(sizeof(struct mrn_handle) <= NCCL_NET_HANDLE_MAXSIZE, "handle fits");
  *listen_comm = NULL;
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSystemError;
  struct mrn_comm *l = NULL;
  if (dev_ep(d) != 0) goto out;
  l = comm_new(d, MRN_LISTEN);
  if (l == NULL) goto out;
  if (post_hello_recv(l) != 0) {
    comm_free(l);
    goto out;
  }
  /* NCCL's handle buffer has no alignment promise: fill a copy, then copy it out */
  struct mrn_handle h;
  memset(&h, 0, sizeof h); /* the stage fields travel zeroed */
  h.magic = MRN_HANDLE_MAGIC;
  h.listen_id = l->id;
  h.addr_len = (uint32_t)d->self_len;
  memcpy(h.addr, d->self, d->self_len);
  memcpy(handle, &h, sizeof h);
  *listen_comm = l;
  res = ncclSuccess;
  TRACE("listen dev=%d -> listenComm=%p id=%u", dev, (void *)l, l->id);
out:
  pthread_mutex_unlock(&d->lock);
  return res;
}

/* connect: stage 0 sends HELLO and returns NULL; later calls return the comm once
 * WELCOME arrived. The pending comm lives in the handle, which NCCL keeps between calls. */
ncclResult_t mrn_connect(int dev, void *handle, void **send_comm) {
  struct mrn_dev *d = dev_at(dev);
  if (d == NULL || handle == NULL || send_comm == NULL) return ncclInvalidArgument;
  /* NCCL's handle buffer has no alignment promise: work on a copy, store the stage back */
  struct mrn_handle hcopy, *h = &hcopy;
  memcpy(h, handle, sizeof *h);
  *send_comm = NULL;
  if (h->magic != MRN_HANDLE_MAGIC || h->addr_len > sizeof h->addr) {
    WARN("connect: not a metaroce handle (magic %#x): the peer runs another net plugin?", h->magic);
    return ncclInvalidArgument;
  }
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSuccess;
  struct mrn_comm *c = h->stage_comm;
  if (c == NULL) {
    res = ncclSystemError;
    if (dev_ep(d) != 0) goto out;
    c = comm_new(d, MRN_SEND);
    if (c == NULL) goto out;
    int rc = mr_av_insert(d->ep, h->addr, h->addr_len, &c->peer);
    if (rc == 0)
      rc = mr_recv(d->ep, c->peer, &c->welcome, sizeof c->welcome, MRN_TAG_WELCOME | c->id, 0,
                   MR_TAGGED, &c->hs_op);
    if (rc != 0) {
      warn_transport("connect", rc);
      comm_free(c);
      goto out;
    }
    c->hs_posted = 1;
    c->hello_out = (struct mrn_hello){.magic = MRN_HELLO_MAGIC, .send_id = c->id,
                                      .addr_len = (uint32_t)d->self_len};
    memcpy(c->hello_out.addr, d->self, d->self_len);
    rc = mr_send(d->ep, c->peer, &c->hello_out, sizeof c->hello_out, MRN_TAG_HELLO | h->listen_id,
                 0, MR_TAGGED, &c->tx_op);
    if (rc != 0) {
      warn_transport("connect: HELLO", rc);
      mr_cancel(d->ep, &c->hs_op);
      wait_until(c, hs_idle, 1000);
      comm_free(c);
      goto out;
    }
    c->tx_posted = 1;
    h->stage_comm = c;
    res = ncclSuccess;
    TRACE("connect dev=%d listen_id=%u -> NULL (HELLO sent, pending sendComm %p id=%u)", dev,
          h->listen_id, (void *)c, c->id);
    goto out;
  }
  if (progress(d) != 0) {
    res = ncclSystemError;
    goto out;
  }
  if (c->tx_op.done && c->tx_op.err != 0) { /* the listener's endpoint never answered */
    WARN("connect: HELLO to the listener failed: %s", mr_strerror(c->tx_op.err));
    res = result_of(c->tx_op.err);
    mr_cancel(d->ep, &c->hs_op);
    wait_until(c, hs_idle, 1000);
    h->stage_comm = NULL;
    comm_free(c);
    goto out;
  }
  if (!c->hs_op.done) {
    c->polls++;
    goto out;
  }
  if (c->hs_op.err != 0 || c->welcome.magic != MRN_WELCOME_MAGIC) {
    WARN("connect: handshake failed: %s", c->hs_op.err ? mr_strerror(c->hs_op.err) : "bad WELCOME");
    res = c->hs_op.err ? result_of(c->hs_op.err) : ncclInternalError;
    h->stage_comm = NULL;
    comm_free(c);
    goto out;
  }
  c->remote_id = c->welcome.recv_id;
  c->hs_posted = 0;
  h->stage_comm = NULL;
  *send_comm = c;
  TRACE("connect dev=%d listen_id=%u -> sendComm=%p id=%u after %ld NULL polls", dev,
        h->listen_id, (void *)c, c->id, c->polls);
out:
  memcpy((char *)handle + offsetof(struct mrn_handle, stage_comm), &h->stage_comm,
         sizeof h->stage_comm);
  pthread_mutex_unlock(&d->lock);
  return res;
}

ncclResult_t mrn_accept(void *listen_comm, void **recv_comm) {
  struct mrn_comm *l = comm_of(listen_comm, MRN_LISTEN);
  if (l == NULL || recv_comm == NULL) return ncclInvalidArgument;
  struct mrn_dev *d = l->dev;
  *recv_comm = NULL;
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSuccess;
  if (progress(d) != 0) {
    res = ncclSystemError;
    goto out;
  }
  if (!l->hs_op.done) {
    l->polls++;
    goto out;
  }
  struct mrn_hello hello = l->hello;
  int err = l->hs_op.err;
  l->hs_posted = 0;
  if (post_hello_recv(l) != 0) { /* ready for the next connect to this listener */
    res = ncclSystemError;
    goto out;
  }
  if (err != 0 || hello.magic != MRN_HELLO_MAGIC || hello.addr_len > sizeof hello.addr) {
    WARN("accept: bad HELLO (%s)", err ? mr_strerror(err) : "magic");
    res = err ? result_of(err) : ncclInternalError;
    goto out;
  }
  res = ncclSystemError;
  struct mrn_comm *c = comm_new(d, MRN_RECV);
  if (c == NULL) goto out;
  c->remote_id = hello.send_id;
  int rc = mr_av_insert(d->ep, hello.addr, hello.addr_len, &c->peer);
  struct mrn_welcome w = {.magic = MRN_WELCOME_MAGIC, .recv_id = c->id};
  if (rc == 0)
    rc = mr_send(d->ep, c->peer, &w, sizeof w, MRN_TAG_WELCOME | hello.send_id, 0,
                 MR_TAGGED | MR_INJECT, NULL);
  if (rc != 0) {
    warn_transport("accept", rc);
    comm_free(c);
    goto out;
  }
  *recv_comm = c;
  res = ncclSuccess;
  TRACE("accept listenComm=%p listen_id=%u -> recvComm=%p id=%u (sender id %u) after %ld NULL"
        " polls", (void *)l, l->id, (void *)c, c->id, c->remote_id, l->polls);
  l->polls = 0;
out:
  pthread_mutex_unlock(&d->lock);
  return res;
}

/* ---- memory ------------------------------------------------------------------- */

ncclResult_t mrn_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  if (comm_of(comm, 0) == NULL || mhandle == NULL) return ncclInvalidArgument;
  *mhandle = NULL;
  if (type != NCCL_PTR_HOST) {
    TRACE("regMr comm=%p data=%p size=%zu type=%d -> refused", comm, data, size, type);
    WARN("regMr: memory type %d refused: this transport moves host memory only "
         "(ptrSupport=NCCL_PTR_HOST, no GPUDirect); NCCL stages GPU buffers through host memory",
         type);
    return ncclInternalError;
  }
  if (data == NULL && size > 0) return ncclInvalidArgument;
  struct mrn_mr *mr = malloc(sizeof *mr);
  if (mr == NULL) return ncclSystemError;
  mr->magic = MRN_MR_MAGIC;
  mr->base = (uintptr_t)data;
  mr->size = size;
  *mhandle = mr;
  TRACE("regMr comm=%p data=%p size=%zu type=%d -> mhandle=%p", comm, data, size, type,
        (void *)mr);
  return ncclSuccess;
}

ncclResult_t mrn_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset,
                               int fd, void **mhandle) {
  (void)comm, (void)data, (void)size, (void)offset, (void)fd;
  if (mhandle) *mhandle = NULL;
  WARN("regMrDmaBuf (type %d) refused: host memory only, no dma-buf", type);
  return ncclInternalError;
}

ncclResult_t mrn_dereg_mr(void *comm, void *mhandle) {
  (void)comm;
  struct mrn_mr *mr = mhandle;
  if (mr == NULL || mr->magic != MRN_MR_MAGIC) return ncclInvalidArgument;
  TRACE("deregMr comm=%p mhandle=%p", comm, mhandle);
  mr->magic = 0;
  free(mr);
  return ncclSuccess;
}

/* A buffer must lie inside the region registered for it (zero bytes need no region). */
static int in_region(void *mhandle, const void *data, size_t size) {
  if (size == 0) return 1;
  struct mrn_mr *mr = mhandle;
  if (mr == NULL || mr->magic != MRN_MR_MAGIC) return 0;
  uintptr_t p = (uintptr_t)data;
  return p >= mr->base && size <= mr->size && p - mr->base <= mr->size - size;
}

/* ---- data --------------------------------------------------------------------- */

static struct mrn_req *req_new(struct mrn_comm *c, int kind, int n) {
  for (int i = 0; i < MRN_MAX_REQS; i++) {
    struct mrn_req *r = &c->reqs[i];
    if (r->used) continue;
    r->used = 1;
    r->kind = kind;
    r->n = n;
    r->ndone = 0;
    for (int j = 0; j < n; j++) memset(&r->ops[j].done, 0, sizeof r->ops[j] - offsetof(struct mrn_op, done));
    return r;
  }
  return NULL; /* NCCL_NET_MAX_REQUESTS in flight: the caller retries (request NULL) */
}

static uint64_t data_tag(uint32_t send_id, int tag) {
  return ((uint64_t)send_id << 32) | (uint32_t)tag;
}

ncclResult_t mrn_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle,
                       void **request) {
  struct mrn_comm *c = comm_of(send_comm, MRN_SEND);
  if (c == NULL || request == NULL) return ncclInvalidArgument;
  *request = NULL;
  if (!in_region(mhandle, data, size)) {
    WARN("isend: %zu bytes at %p are outside the registered region", size, data);
    return ncclInvalidArgument;
  }
  if (size > mr_max_msg_size()) {
    WARN("isend: %zu bytes exceed the transport's message size limit %llu", size,
         (unsigned long long)mr_max_msg_size());
    return ncclInvalidArgument;
  }
  struct mrn_dev *d = c->dev;
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSuccess;
  struct mrn_req *r = req_new(c, MRN_SEND, 1);
  if (r == NULL) goto out;
  int rc = mr_send(d->ep, c->peer, data, size, data_tag(c->id, tag), 0, MR_TAGGED, &r->ops[0]);
  if (rc != 0) {
    r->used = 0;
    if (rc != -MR_EAGAIN) {
      warn_transport("isend", rc);
      res = result_of(rc);
    }
    goto out;
  }
  r->ops[0].cap = size;
  *request = r;
out:
  pthread_mutex_unlock(&d->lock);
  TRACE("isend sendComm=%p data=%p size=%zu tag=%d mhandle=%p -> request=%p", send_comm, data,
        size, tag, mhandle, *request);
  return res;
}

ncclResult_t mrn_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags,
                       void **mhandles, void **request) {
  struct mrn_comm *c = comm_of(recv_comm, MRN_RECV);
  if (c == NULL || request == NULL || data == NULL || sizes == NULL || tags == NULL)
    return ncclInvalidArgument;
  /* *request may hold NCCL_NET_OPTIONAL_RECV_COMPLETION on entry: a hint; we always
   * complete receives. */
  *request = NULL;
  if (n < 1 || n > MRN_MAX_RECVS) {
    WARN("irecv: %d buffers in one group (1..%d, maxRecvs)", n, MRN_MAX_RECVS);
    return ncclInvalidArgument;
  }
  for (int i = 0; i < n; i++) {
    if (!in_region(mhandles ? mhandles[i] : NULL, data[i], sizes[i])) {
      WARN("irecv: buffer %d (%zu bytes at %p) is outside its registered region", i, sizes[i],
           data[i]);
      return ncclInvalidArgument;
    }
  }
  struct mrn_dev *d = c->dev;
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSuccess;
  struct mrn_req *r = req_new(c, MRN_RECV, n);
  if (r == NULL) goto out;
  for (int i = 0; i < n; i++) {
    r->ops[i].cap = sizes[i];
    int rc = mr_recv(d->ep, c->peer, data[i], sizes[i], data_tag(c->remote_id, tags[i]), 0,
                     MR_TAGGED, &r->ops[i]);
    if (rc != 0) {
      /* undo the part of the group already posted; the slot frees when those cancel */
      r->n = i;
      for (int j = 0; j < i; j++) mr_cancel(d->ep, &r->ops[j]);
      if (i == 0) r->used = 0;
      else r->zombie = 1;
      if (rc != -MR_EAGAIN) {
        warn_transport("irecv", rc);
        res = result_of(rc);
      }
      goto out;
    }
  }
  *request = r;
out:
  pthread_mutex_unlock(&d->lock);
  if (mrn_tracing()) {
    long long v[MRN_MAX_RECVS];
    char sz[256], tg[256], da[512], mh[512];
    for (int i = 0; i < n; i++) v[i] = (long long)sizes[i];
    list_of(sz, sizeof sz, n, v);
    for (int i = 0; i < n; i++) v[i] = tags[i];
    list_of(tg, sizeof tg, n, v);
    for (int i = 0; i < n; i++) v[i] = (long long)(uintptr_t)data[i];
    list_of(da, sizeof da, n, v);
    for (int i = 0; i < n; i++) v[i] = (long long)(uintptr_t)(mhandles ? mhandles[i] : NULL);
    mrn_trace("irecv recvComm=%p n=%d sizes=%s tags=%s datas=%s mhandles=%s -> request=%p",
              recv_comm, n, sz, tg, da, list_of(mh, sizeof mh, n, v), *request);
  }
  return res;
}

ncclResult_t mrn_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles,
                        void **request) {
  (void)recv_comm, (void)n, (void)data, (void)sizes, (void)mhandles;
  /* host memory: the received bytes are visible once test() says done */
  if (request) *request = NULL;
  TRACE("iflush recvComm=%p n=%d -> request=NULL", recv_comm, n);
  return ncclSuccess;
}

static void reap_zombies(struct mrn_comm *c) {
  for (int i = 0; i < MRN_MAX_REQS; i++) {
    struct mrn_req *r = &c->reqs[i];
    if (r->used && r->zombie && r->ndone >= r->n) r->used = 0, r->zombie = 0;
  }
}

ncclResult_t mrn_test(void *request, int *done, int *sizes) {
  struct mrn_req *r = request;
  if (r == NULL || done == NULL || !r->used || r->zombie) return ncclInvalidArgument;
  struct mrn_comm *c = r->comm;
  struct mrn_dev *d = c->dev;
  *done = 0;
  pthread_mutex_lock(&d->lock);
  ncclResult_t res = ncclSuccess;
  if (r->ndone < r->n && progress(d) != 0) {
    res = ncclSystemError;
    goto out;
  }
  reap_zombies(c);
  if (r->ndone < r->n) {
    r->polls++;
    goto out;
  }
  for (int i = 0; i < r->n; i++) {
    struct mrn_op *op = &r->ops[i];
    if (op->err == -MR_ETRUNC) {
      WARN("%s: a message of %llu bytes arrived for a %zu-byte buffer (tag group entry %d)",
           r->kind == MRN_RECV ? "irecv" : "isend",
           (unsigned long long)(op->len + op->olen), op->cap, i);
      res = ncclInvalidUsage;
    } else if (op->err != 0) {
      WARN("%s: %s", r->kind == MRN_RECV ? "irecv" : "isend", mr_strerror(op->err));
      res = result_of(op->err);
    }
    if (sizes != NULL) sizes[i] = (int)(r->kind == MRN_SEND ? op->cap : op->len);
  }
  *done = 1;
  r->used = 0;
  if (mrn_tracing()) {
    long long v[MRN_MAX_RECVS];
    char sz[256];
    for (int i = 0; i < r->n; i++)
      v[i] = (long long)(r->kind == MRN_SEND ? r->ops[i].cap : r->ops[i].len);
    mrn_trace("test request=%p (%s) -> done sizes=%s rc=%d after %ld polls", request,
              r->kind == MRN_SEND ? "isend" : "irecv", list_of(sz, sizeof sz, r->n, v), res,
              r->polls);
  }
  r->polls = 0;
out:
  pthread_mutex_unlock(&d->lock);
  return res;
}

/* ---- close -------------------------------------------------------------------- */

static ncclResult_t close_comm(void *comm, int kind) {
  struct mrn_comm *c = comm_of(comm, kind);
  if (c == NULL) return ncclInvalidArgument;
  TRACE("%s comm=%p id=%u", kind == MRN_SEND ? "closeSend" : kind == MRN_RECV ? "closeRecv"
                                                                             : "closeListen",
        comm, c->id);
  struct mrn_dev *d = c->dev;
  pthread_mutex_lock(&d->lock);
  if (kind == MRN_SEND) {
    /* NCCL closes idle comms; sends still in flight get time to be acknowledged */
    wait_until(c, all_idle, MRN_CLOSE_WAIT_MS);
  } else {
    if (c->hs_posted && !c->hs_op.done) mr_cancel(d->ep, &c->hs_op);
    for (int i = 0; i < MRN_MAX_REQS; i++) {
      struct mrn_req *r = &c->reqs[i];
      if (!r->used) continue;
      for (int j = 0; j < r->n; j++)
        if (!r->ops[j].done) mr_cancel(d->ep, &r->ops[j]);
    }
    wait_until(c, all_idle, MRN_CLOSE_WAIT_MS);
  }
  comm_free(c);
  pthread_mutex_unlock(&d->lock);
  return ncclSuccess;
}

ncclResult_t mrn_close_send(void *c) { return close_comm(c, MRN_SEND); }
ncclResult_t mrn_close_recv(void *c) { return close_comm(c, MRN_RECV); }
ncclResult_t mrn_close_listen(void *c) { return close_comm(c, MRN_LISTEN); }
