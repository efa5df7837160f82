/*
 * The exported plugin structs, ncclNetPlugin_v12 down to ncclNetPlugin_v6, each an
 * adapter from that version's signatures (nccl/net.h) onto plugin.c. NCCL looks for
 * the newest version it knows, so one library serves every NCCL that loads v6 or newer.
 * What differs between versions: the properties struct, int vs size_t sizes (v6..v8
 * take int: NCCL keeps them under MAX_NET_SIZE), device-offload handles (v7+, ignored:
 * netDeviceType is HOST), the comm config and profiler handles (v10+, ignored), the
 * per-communicator context (v12).
 */
#include <stdlib.h>
#include <string.h>

#include "mrnccl.h"

#define EXPORT __attribute__((visibility("default")))

/* ---- shared pieces ------------------------------------------------------------ */

static ncclResult_t check_int_size(int size) { return size < 0 ? ncclInvalidArgument : ncclSuccess; }

static ncclResult_t isend_int(void *c, void *data, int size, int tag, void *mh, void **req) {
  if (check_int_size(size) != ncclSuccess) return ncclInvalidArgument;
  return mrn_isend(c, data, (size_t)size, tag, mh, req);
}

static ncclResult_t irecv_int(void *c, int n, void **data, int *sizes, int *tags, void **mh,
                              void **req) {
  size_t s[MRN_MAX_RECVS];
  if (n < 1 || n > MRN_MAX_RECVS || sizes == NULL) return mrn_irecv(c, n, data, NULL, tags, mh, req);
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0) return ncclInvalidArgument;
    s[i] = (size_t)sizes[i];
  }
  return mrn_irecv(c, n, data, s, tags, mh, req);
}

static ncclResult_t reg_mr_int(void *c, void *data, int size, int type, void **mh) {
  if (size < 0) return ncclInvalidArgument;
  return mrn_reg_mr(c, data, (size_t)size, type, mh);
}

/* Device-offload handles (v7+): only requested for NCCL_NET_DEVICE_UNPACK, which we
 * never advertise; nothing to fill. */
static ncclResult_t connect_dc(int dev, void *h, void **sc, ncclNetDeviceHandle_v7_t **dc) {
  (void)dc;
  return mrn_connect(dev, h, sc);
}
static ncclResult_t accept_dc(void *l, void **rc, ncclNetDeviceHandle_v7_t **dc) {
  (void)dc;
  return mrn_accept(l, rc);
}

static ncclResult_t init_v6(ncclDebugLogger_t log) { return mrn_init(log, 6); }
static ncclResult_t init_v7(ncclDebugLogger_t log) { return mrn_init(log, 7); }
static ncclResult_t init_v8(ncclDebugLogger_t log) { return mrn_init(log, 8); }
static ncclResult_t init_v9(ncclDebugLogger_t log) { return mrn_init(log, 9); }

#define COMMON_PROPS(out, p)        \
  do {                              \
    (out)->name = (p).name;         \
    (out)->pciPath = (p).pciPath;   \
    (out)->guid = (p).guid;         \
    (out)->ptrSupport = (p).ptrSupport; \
    (out)->speed = (p).speed;       \
    (out)->port = (p).port;         \
    (out)->latency = (p).latency;   \
    (out)->maxComms = (p).maxComms; \
    (out)->maxRecvs = (p).maxRecvs; \
  } while (0)

#define OFFLOAD_PROPS(out)                                   \
  do {                                                       \
    (out)->netDeviceType = NCCL_NET_DEVICE_HOST;             \
    (out)->netDeviceVersion = NCCL_NET_DEVICE_INVALID_VERSION; \
  } while (0)

#define V9_PROPS(out, p, dev)                        \
  do {                                               \
    (out)->regIsGlobal = 0;                          \
    (out)->forceFlush = 0;                           \
    (out)->vProps.ndevs = 1;                         \
    (out)->vProps.devs[0] = (dev);                   \
    (out)->maxP2pBytes = (p).maxP2pBytes;            \
    (out)->maxCollBytes = (p).maxCollBytes;          \
  } while (0)

/* ---- v6 ----------------------------------------------------------------------- */

static ncclResult_t props_v6(int dev, ncclNetProperties_v6_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  return ncclSuccess;
}

EXPORT const ncclNet_v6_t ncclNetPlugin_v6 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v6,
    .devices = mrn_devices,
    .getProperties = props_v6,
    .listen = mrn_listen,
    .connect = mrn_connect,
    .accept = mrn_accept,
    .regMr = reg_mr_int,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_int,
    .irecv = irecv_int,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
};

/* ---- v7 ----------------------------------------------------------------------- */

static ncclResult_t props_v7(int dev, ncclNetProperties_v7_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  return ncclSuccess;
}

EXPORT const ncclNet_v7_t ncclNetPlugin_v7 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v7,
    .devices = mrn_devices,
    .getProperties = props_v7,
    .listen = mrn_listen,
    .connect = connect_dc,
    .accept = accept_dc,
    .regMr = reg_mr_int,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_int,
    .irecv = irecv_int,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
};

/* ---- v8 ----------------------------------------------------------------------- */

static ncclResult_t props_v8(int dev, ncclNetProperties_v8_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  out->regIsGlobal = 0;
  return ncclSuccess;
}

EXPORT const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v8,
    .devices = mrn_devices,
    .getProperties = props_v8,
    .listen = mrn_listen,
    .connect = connect_dc,
    .accept = accept_dc,
    .regMr = mrn_reg_mr,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_int,
    .irecv = irecv_int,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
};

/* ---- v9 ----------------------------------------------------------------------- */

static ncclResult_t props_v9(int dev, ncclNetProperties_v9_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  V9_PROPS(out, p, dev);
  return ncclSuccess;
}

EXPORT const ncclNet_v9_t ncclNetPlugin_v9 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v9,
    .devices = mrn_devices,
    .getProperties = props_v9,
    .listen = mrn_listen,
    .connect = connect_dc,
    .accept = accept_dc,
    .regMr = mrn_reg_mr,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = mrn_isend,
    .irecv = mrn_irecv,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL, /* no NIC fusion: each netdev is one device */
};

/* ---- v10 ---------------------------------------------------------------------- */

static ncclResult_t init_v10(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  return mrn_init(log, 10);
}

static ncclResult_t init_v11(ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  return mrn_init(log, 11);
}

static ncclResult_t props_v10(int dev, ncclNetProperties_v10_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  V9_PROPS(out, p, dev);
  return ncclSuccess;
}

/* The comm config's trafficClass is not applied per comm: the device's endpoint is
 * shared, its DSCP comes from MR_CONFIG (dscp=). */
static ncclResult_t connect_v10(int dev, ncclNetCommConfig_v10_t *cfg, void *h, void **sc,
                                ncclNetDeviceHandle_v10_t **dc) {
  (void)cfg, (void)dc;
  return mrn_connect(dev, h, sc);
}

static ncclResult_t isend_ph(void *c, void *data, size_t size, int tag, void *mh, void *ph,
                             void **req) {
  (void)ph;
  return mrn_isend(c, data, size, tag, mh, req);
}

static ncclResult_t irecv_ph(void *c, int n, void **data, size_t *sizes, int *tags, void **mh,
                             void **ph, void **req) {
  (void)ph;
  return mrn_irecv(c, n, data, sizes, tags, mh, req);
}

EXPORT const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v10,
    .devices = mrn_devices,
    .getProperties = props_v10,
    .listen = mrn_listen,
    .connect = connect_v10,
    .accept = accept_dc,
    .regMr = mrn_reg_mr,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_ph,
    .irecv = irecv_ph,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
};

/* ---- v11 ---------------------------------------------------------------------- */

static ncclResult_t props_v11(int dev, ncclNetProperties_v11_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  V9_PROPS(out, p, dev);
  out->fabricId = 0; /* one fabric: every device reaches every other */
  return ncclSuccess;
}

static ncclResult_t connect_v11(int dev, ncclNetCommConfig_v11_t *cfg, void *h, void **sc,
                                ncclNetDeviceHandle_v11_t **dc) {
  (void)cfg, (void)dc;
  return mrn_connect(dev, h, sc);
}

static ncclResult_t net_path_v11(uint64_t f0, uint64_t f1, ncclNetPath_v11_t *path) {
  (void)f0, (void)f1;
  if (path == NULL) return ncclInvalidArgument;
  path->loc = NET_LOC_DCL0;
  return ncclSuccess;
}

EXPORT const ncclNet_v11_t ncclNetPlugin_v11 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v11,
    .devices = mrn_devices,
    .getProperties = props_v11,
    .listen = mrn_listen,
    .connect = connect_v11,
    .accept = accept_dc,
    .regMr = mrn_reg_mr,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_ph,
    .irecv = irecv_ph,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
    .getNetPath = net_path_v11,
};

/* ---- v12 ---------------------------------------------------------------------- */

/* The per-communicator context NCCL (v12) threads through listen/connect/finalize. */
struct mrn_ctx {
  uint64_t comm_id;
  int traffic_class;
};

static ncclResult_t init_v12(void **ctx, uint64_t comm_id, ncclNetCommConfig_v12_t *cfg,
                             ncclDebugLogger_t log, ncclProfilerCallback_t prof) {
  (void)prof;
  if (ctx == NULL) return ncclInvalidArgument;
  struct mrn_ctx *c = calloc(1, sizeof *c);
  if (c == NULL) return ncclSystemError;
  c->comm_id = comm_id;
  c->traffic_class = cfg ? cfg->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  ncclResult_t r = mrn_init(log, 12);
  if (r != ncclSuccess) {
    free(c);
    return r;
  }
  *ctx = c;
  return ncclSuccess;
}

static ncclResult_t finalize_v12(void *ctx) {
  free(ctx);
  return mrn_finalize();
}

static ncclResult_t props_v12(int dev, ncclNetProperties_v12_t *out) {
  struct mrn_props p;
  ncclResult_t r = mrn_get_properties(dev, &p);
  if (r != ncclSuccess || out == NULL) return r != ncclSuccess ? r : ncclInvalidArgument;
  memset(out, 0, sizeof *out);
  COMMON_PROPS(out, p);
  OFFLOAD_PROPS(out);
  V9_PROPS(out, p, dev);
  out->maxMultiRequestSize = 1; /* no NCCL_NET_MULTI_REQUEST batching */
  out->railId = NCCL_NET_ID_UNDEF;
  out->planeId = NCCL_NET_ID_UNDEF;
  return ncclSuccess;
}

static ncclResult_t listen_v12(void *ctx, int dev, void *h, void **lc) {
  (void)ctx;
  return mrn_listen(dev, h, lc);
}

static ncclResult_t connect_v12(void *ctx, int dev, void *h, void **sc,
                                ncclNetDeviceHandle_v12_t **dc) {
  (void)ctx, (void)dc;
  return mrn_connect(dev, h, sc);
}

static ncclResult_t set_net_attr_v12(void *ctx, ncclNetAttr_v12_t *attr) {
  (void)ctx, (void)attr; /* tuning hints (peers, flows per peer): the transport paces itself */
  return ncclSuccess;
}

EXPORT const ncclNet_v12_t ncclNetPlugin_v12 = {
    .name = MRN_PLUGIN_NAME,
    .init = init_v12,
    .devices = mrn_devices,
    .getProperties = props_v12,
    .listen = listen_v12,
    .connect = connect_v12,
    .accept = accept_dc,
    .regMr = mrn_reg_mr,
    .regMrDmaBuf = mrn_reg_mr_dmabuf,
    .deregMr = mrn_dereg_mr,
    .isend = isend_ph,
    .irecv = irecv_ph,
    .iflush = mrn_iflush,
    .test = mrn_test,
    .closeSend = mrn_close_send,
    .closeRecv = mrn_close_recv,
    .closeListen = mrn_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL,
    .finalize = finalize_v12,
    .setNetAttr = set_net_attr_v12,
};
