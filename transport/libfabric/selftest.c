/*
 * selftest.c: the provider's semantics through libfabric's public API, with
 * the real transport, in one process: two endpoints on 127.0.0.1 talking to
 * each other. Covers what fi_pingpong and Open MPI do not exercise directly:
 * FI_PEEK/FI_CLAIM/FI_DISCARD, truncation, cancel, remote CQ data, FI_SOURCE,
 * directed receives, FI_INJECT with a completion, selective completion,
 * fi_cq_sread, FI_WAIT_FD, AV lookup/straddr/remove.
 *
 *   FI_PROVIDER_PATH=build MR_CONFIG=addr=127.0.0.1 build/selftest
 * prints "ok <name>" per check and exits 0, or names the failed check.
 */
#include <poll.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#define CHECK(cond, ...)                                                     \
	do {                                                                 \
		if (!(cond)) {                                               \
			fprintf(stderr, "FAIL %s:%d: %s: ", __func__, __LINE__, \
				#cond);                                      \
			fprintf(stderr, __VA_ARGS__);                        \
			fprintf(stderr, "\n");                               \
			exit(1);                                             \
		}                                                            \
	} while (0)
#define FI(call)                                                             \
	do {                                                                 \
		int _rc = (int)(call);                                       \
		CHECK(_rc == 0, "%s -> %d (%s)", #call, _rc, fi_strerror(-_rc)); \
	} while (0)

struct side {
	struct fid_ep *ep;
	struct fid_cq *txcq, *rxcq;
	fi_addr_t self, peer; /* this side's AV indexes */
};

static struct fi_info *info;
static struct fid_fabric *fabric;
static struct fid_domain *domain;
static struct fid_av *av;
static struct side a, b;
static fi_addr_t addr_a, addr_b;

static double now(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Read one entry (success: 1; error entry: -FI_EAVAIL, *err filled). */
static int wait_cq(struct fid_cq *cq, struct fi_cq_tagged_entry *e,
		   fi_addr_t *src, struct fi_cq_err_entry *err, double secs)
{
	double end = now() + secs;
	for (;;) {
		ssize_t n = src ? fi_cq_readfrom(cq, e, 1, src) : fi_cq_read(cq, e, 1);
		if (n == 1)
			return 1;
		if (n == -FI_EAVAIL) {
			memset(err, 0, sizeof(*err));
			CHECK(fi_cq_readerr(cq, err, 0) == 1, "readerr");
			return -FI_EAVAIL;
		}
		CHECK(n == -FI_EAGAIN, "cq_read -> %zd (%s)", n, fi_strerror((int)-n));
		if (now() > end)
			return 0;
	}
}

static void expect_ok(struct fid_cq *cq, void *ctx, struct fi_cq_tagged_entry *e,
		      fi_addr_t *src)
{
	struct fi_cq_err_entry err;
	int rc = wait_cq(cq, e, src, &err, 10);
	CHECK(rc == 1, "no completion for %p (rc %d, err %d %s)", ctx, rc,
	      err.err, fi_strerror(err.err));
	CHECK(e->op_context == ctx, "context %p, want %p", e->op_context, ctx);
}

static void expect_err(struct fid_cq *cq, void *ctx, int want,
		       struct fi_cq_err_entry *err)
{
	struct fi_cq_tagged_entry e;
	int rc = wait_cq(cq, &e, NULL, err, 10);
	CHECK(rc == -FI_EAVAIL, "want error %d, got rc %d", want, rc);
	CHECK(err->err == want, "err %d (%s), want %d", err->err,
	      fi_strerror(err->err), want);
	CHECK(err->op_context == ctx, "err context %p, want %p", err->op_context, ctx);
}

static void expect_nothing(struct fid_cq *cq, double secs)
{
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;
	int rc = wait_cq(cq, &e, NULL, &err, secs);
	CHECK(rc == 0, "unexpected completion (rc %d, context %p)", rc,
	      rc == 1 ? e.op_context : err.op_context);
}

static void open_side(struct side *s, uint64_t cq_bind_flags, bool split)
{
	struct fi_cq_attr cq_attr = {.format = FI_CQ_FORMAT_TAGGED,
				     .wait_obj = FI_WAIT_UNSPEC};
	FI(fi_endpoint(domain, info, &s->ep, NULL));
	FI(fi_cq_open(domain, &cq_attr, &s->rxcq, NULL));
	if (split) {
		FI(fi_cq_open(domain, &cq_attr, &s->txcq, NULL));
		FI(fi_ep_bind(s->ep, &s->txcq->fid, FI_TRANSMIT | cq_bind_flags));
		FI(fi_ep_bind(s->ep, &s->rxcq->fid, FI_RECV | cq_bind_flags));
	} else {
		s->txcq = s->rxcq;
		FI(fi_ep_bind(s->ep, &s->rxcq->fid, FI_TRANSMIT | FI_RECV | cq_bind_flags));
	}
	FI(fi_ep_bind(s->ep, &av->fid, 0));
	FI(fi_enable(s->ep));
}

static fi_addr_t insert_name(struct fid_ep *ep)
{
	char name[64];
	size_t len = 0;
	fi_addr_t fa;
	CHECK(fi_getname(&ep->fid, NULL, &len) == -FI_ETOOSMALL && len > 0,
	      "getname size probe");
	CHECK(len <= sizeof(name), "name too long");
	FI(fi_getname(&ep->fid, name, &len));
	CHECK(fi_av_insert(av, name, 1, &fa, 0, NULL) == 1, "av_insert");
	return fa;
}

static void setup(void)
{
	struct fi_info *hints = fi_allocinfo();
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_MSG | FI_TAGGED | FI_DIRECTED_RECV | FI_SOURCE;
	hints->mode = FI_CONTEXT;
	hints->fabric_attr->prov_name = strdup("metaroce");
	hints->domain_attr->av_type = FI_AV_TABLE;
	/* The API version this was written to, or the image's libfabric's own when that
	 * is older (Debian 11: 1.11), as an application built against it would ask. */
	uint32_t version = FI_VERSION(1, 17);
	if (FI_VERSION_LT(fi_version(), version))
		version = fi_version();
	FI(fi_getinfo(version, NULL, NULL, 0, hints, &info));
	fi_freeinfo(hints);
	CHECK(!strcmp(info->fabric_attr->prov_name, "metaroce"), "provider %s",
	      info->fabric_attr->prov_name);
	FI(fi_fabric(info->fabric_attr, &fabric, NULL));
	FI(fi_domain(fabric, info, &domain, NULL));
	struct fi_av_attr av_attr = {.type = FI_AV_TABLE};
	FI(fi_av_open(domain, &av_attr, &av, NULL));
	open_side(&a, 0, true);                         /* tx and rx CQs */
	open_side(&b, FI_SELECTIVE_COMPLETION, false);  /* one CQ, selective */
	addr_a = insert_name(a.ep);
	addr_b = insert_name(b.ep);
	CHECK(addr_a == 0 && addr_b == 1, "FI_AV_TABLE indexes %lu %lu",
	      (unsigned long)addr_a, (unsigned long)addr_b);
	CHECK(insert_name(a.ep) == addr_a, "re-inserting a name gives its index");
	puts("ok setup");
}

static void fill(char *p, size_t n, int seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (char)(i * 7 + (size_t)seed);
}

static void t_tagged_source_data(void)
{
	char out[1000], in[1000];
	struct fi_context sc, rc;
	struct fi_cq_tagged_entry e;
	fi_addr_t src = 12345;

	fill(out, sizeof(out), 1);
	/* B posts with FI_COMPLETION because its binding is selective. */
	struct iovec iov = {.iov_base = in, .iov_len = sizeof(in)};
	struct fi_msg_tagged m = {.msg_iov = &iov, .iov_count = 1,
				  .addr = FI_ADDR_UNSPEC, .tag = 0x1200,
				  .ignore = 0xff, .context = &rc};
	FI(fi_trecvmsg(b.ep, &m, FI_COMPLETION));
	FI(fi_tsenddata(a.ep, out, sizeof(out), NULL, 0xfeedULL, addr_b, 0x12ab, &sc));
	expect_ok(a.txcq, &sc, &e, NULL);
	CHECK(e.flags & FI_SEND && e.flags & FI_TAGGED, "send flags %#lx",
	      (unsigned long)e.flags);
	expect_ok(b.rxcq, &rc, &e, &src);
	CHECK(e.len == sizeof(out) && !memcmp(in, out, sizeof(out)), "data");
	CHECK(e.tag == 0x12ab, "tag %#lx", (unsigned long)e.tag);
	CHECK(e.flags & FI_REMOTE_CQ_DATA && e.data == 0xfeed, "cq data");
	CHECK(e.flags & FI_RECV && e.flags & FI_TAGGED, "recv flags");
	CHECK(src == addr_a, "FI_SOURCE %lu, want %lu", (unsigned long)src,
	      (unsigned long)addr_a);
	puts("ok tagged_source_data");
}

static void t_truncation(void)
{
	char out[100], in[10];
	struct fi_context sc, rc;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;

	fill(out, sizeof(out), 2);
	FI(fi_trecv(a.ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, 7, 0, &rc));
	FI(fi_tsend(b.ep, out, sizeof(out), NULL, addr_a, 7, &sc));
	expect_err(a.rxcq, &rc, FI_ETRUNC, &err);
	CHECK(err.len == sizeof(in) && err.olen == sizeof(out) - sizeof(in),
	      "len %zu olen %zu", err.len, err.olen);
	CHECK(err.tag == 7, "tag");
	(void)e;
	puts("ok truncation");
}

static void t_cancel(void)
{
	char in[8];
	struct fi_context rc;
	struct fi_cq_err_entry err;

	FI(fi_trecv(a.ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, 999, 0, &rc));
	FI(fi_cancel(&a.ep->fid, &rc));
	expect_err(a.rxcq, &rc, FI_ECANCELED, &err);
	CHECK(fi_cancel(&a.ep->fid, &rc) == -FI_ENOENT, "second cancel");
	puts("ok cancel");
}

static void peek(struct side *s, uint64_t tag, uint64_t flags, void *ctx)
{
	struct fi_msg_tagged m = {.addr = FI_ADDR_UNSPEC, .tag = tag, .context = ctx};
	FI(fi_trecvmsg(s->ep, &m, FI_PEEK | FI_COMPLETION | flags));
}

static void t_peek_claim_discard(void)
{
	char out[300], in[300];
	struct fi_context pc, sc;
	struct fi_cq_tagged_entry e;
	struct fi_cq_err_entry err;

	/* A miss is an FI_ENOMSG error completion. */
	peek(&a, 55, 0, &pc);
	expect_err(a.rxcq, &pc, FI_ENOMSG, &err);

	fill(out, sizeof(out), 3);
	FI(fi_tsenddata(b.ep, out, sizeof(out), NULL, 77, addr_a, 55, &sc));
	/* Peek until the message is there; it stays unmatched. */
	double end = now() + 10;
	for (;;) {
		peek(&a, 55, 0, &pc);
		int rc = wait_cq(a.rxcq, &e, NULL, &err, 10);
		if (rc == 1)
			break;
		CHECK(rc == -FI_EAVAIL && err.err == FI_ENOMSG, "peek");
		CHECK(now() < end, "message never arrived");
	}
	CHECK(e.op_context == &pc && e.len == sizeof(out) && e.tag == 55, "peek entry");
	CHECK(e.flags & FI_REMOTE_CQ_DATA && e.data == 77, "peek cq data");

	/* Claim it, then receive the claimed message by context. */
	peek(&a, 55, FI_CLAIM, &pc);
	expect_ok(a.rxcq, &pc, &e, NULL);
	peek(&a, 55, 0, &sc); /* claimed: no longer visible */
	expect_err(a.rxcq, &sc, FI_ENOMSG, &err);
	struct iovec iov = {.iov_base = in, .iov_len = sizeof(in)};
	struct fi_msg_tagged m = {.msg_iov = &iov, .iov_count = 1,
				  .addr = FI_ADDR_UNSPEC, .context = &pc};
	FI(fi_trecvmsg(a.ep, &m, FI_CLAIM | FI_COMPLETION));
	expect_ok(a.rxcq, &pc, &e, NULL);
	CHECK(e.len == sizeof(out) && !memcmp(in, out, sizeof(out)), "claimed data");

	/* FI_PEEK|FI_CLAIM then FI_CLAIM|FI_DISCARD drops it. */
	FI(fi_tinject(b.ep, out, 16, addr_a, 56));
	for (end = now() + 10;;) {
		peek(&a, 56, FI_CLAIM, &pc);
		if (wait_cq(a.rxcq, &e, NULL, &err, 10) == 1)
			break;
		CHECK(now() < end, "injected message never arrived");
	}
	struct fi_msg_tagged d = {.addr = FI_ADDR_UNSPEC, .context = &pc};
	FI(fi_trecvmsg(a.ep, &d, FI_CLAIM | FI_DISCARD | FI_COMPLETION));
	expect_ok(a.rxcq, &pc, &e, NULL);
	peek(&a, 56, 0, &pc);
	expect_err(a.rxcq, &pc, FI_ENOMSG, &err);
	puts("ok peek_claim_discard");
}

static void t_inject_completion_and_selective(void)
{
	char out[64], in[64];
	struct fi_context sc, rc, rc2;
	struct fi_cq_tagged_entry e;

	/* fi_sendmsg(FI_INJECT) with a completion: the buffer is reusable at
	 * once and the completion still comes, with the caller's context. */
	fill(out, sizeof(out), 4);
	FI(fi_recv(b.ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, &rc));
	struct iovec iov = {.iov_base = out, .iov_len = sizeof(out)};
	struct fi_msg m = {.msg_iov = &iov, .iov_count = 1, .addr = addr_b,
			   .context = &sc};
	FI(fi_sendmsg(a.ep, &m, FI_INJECT | FI_TRANSMIT_COMPLETE));
	memset(out, 0, sizeof(out));
	expect_ok(a.txcq, &sc, &e, NULL);
	CHECK(e.flags & FI_MSG, "msg flag");
	/* B's binding is selective and fi_recv has no FI_COMPLETION in its
	 * op_flags: no successful completion, but the data arrives. */
	expect_nothing(b.rxcq, 0.5);
	char ref[64];
	fill(ref, sizeof(ref), 4);
	CHECK(!memcmp(in, ref, sizeof(in)), "injected data");

	/* Selective sender: only FI_COMPLETION sends complete. */
	FI(fi_trecv(a.ep, in, sizeof(in), NULL, addr_b, 9, 0, &rc));
	FI(fi_trecv(a.ep, in, sizeof(in), NULL, addr_b, 9, 0, &rc2));
	struct fi_msg_tagged t = {.msg_iov = &iov, .iov_count = 1, .addr = addr_a,
				  .tag = 9, .context = &sc};
	FI(fi_tsendmsg(b.ep, &t, 0));
	expect_ok(a.rxcq, &rc, &e, NULL);
	expect_nothing(b.txcq, 0.3);
	FI(fi_tsendmsg(b.ep, &t, FI_COMPLETION));
	expect_ok(a.rxcq, &rc2, &e, NULL);
	expect_ok(b.txcq, &sc, &e, NULL);
	puts("ok inject_completion_and_selective");
}

static void t_directed_and_zero(void)
{
	char in1[4], in2[4];
	struct fi_context r1, r2, sc;
	struct fi_cq_tagged_entry e;
	fi_addr_t src;

	/* A receive directed at A itself never takes B's message. */
	FI(fi_trecv(a.ep, in1, sizeof(in1), NULL, addr_a, 3, 0, &r1));
	FI(fi_trecv(a.ep, in2, sizeof(in2), NULL, addr_b, 3, 0, &r2));
	FI(fi_tinject(b.ep, "abcd", 4, addr_a, 3));
	expect_ok(a.rxcq, &r2, &e, &src);
	CHECK(src == addr_b && !memcmp(in2, "abcd", 4), "directed");
	FI(fi_cancel(&a.ep->fid, &r1));
	struct fi_cq_err_entry err;
	expect_err(a.rxcq, &r1, FI_ECANCELED, &err);

	/* Zero bytes, untagged. */
	FI(fi_recv(a.ep, NULL, 0, NULL, FI_ADDR_UNSPEC, &r1));
	FI(fi_send(b.ep, NULL, 0, NULL, addr_a, &sc));
	expect_ok(a.rxcq, &r1, &e, NULL);
	CHECK(e.len == 0 && (e.flags & FI_MSG), "zero-byte");
	puts("ok directed_and_zero");
}

static void t_sread_and_wait_fd(void)
{
	struct fi_cq_tagged_entry e;
	struct fi_context rc;
	char in[8];

	double t0 = now();
	CHECK(fi_cq_sread(a.rxcq, &e, 1, NULL, 200) == -FI_EAGAIN, "sread timeout");
	double took = now() - t0;
	CHECK(took >= 0.15 && took < 2, "sread waited %.3f s", took);

	FI(fi_trecv(a.ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, 4, 0, &rc));
	FI(fi_tinject(b.ep, "12345678", 8, addr_a, 4));
	CHECK(fi_cq_sread(a.rxcq, &e, 1, NULL, 10000) == 1 && e.op_context == &rc,
	      "sread completion");

	/* FI_WAIT_FD on a third endpoint's CQ. */
	struct fi_cq_attr attr = {.format = FI_CQ_FORMAT_CONTEXT, .wait_obj = FI_WAIT_FD};
	struct fid_cq *cq;
	struct fid_ep *ep;
	int fd = -1;
	FI(fi_endpoint(domain, info, &ep, NULL));
	FI(fi_cq_open(domain, &attr, &cq, NULL));
	FI(fi_ep_bind(ep, &cq->fid, FI_TRANSMIT | FI_RECV));
	FI(fi_ep_bind(ep, &av->fid, 0));
	FI(fi_enable(ep));
	fi_addr_t addr_c = insert_name(ep);
	FI(fi_control(&cq->fid, FI_GETWAIT, &fd));
	CHECK(fd >= 0, "wait fd");
	FI(fi_trecv(ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, 5, 0, &rc));
	struct fid *fids[1] = {&cq->fid};
	FI(fi_trywait(fabric, fids, 1));
	FI(fi_tinject(a.ep, "x", 1, addr_c, 5));
	struct pollfd p = {.fd = fd, .events = POLLIN};
	CHECK(poll(&p, 1, 10000) == 1, "wait fd never became readable");
	struct fi_cq_entry ce;
	double end = now() + 10;
	while (fi_cq_read(cq, &ce, 1) != 1)
		CHECK(now() < end, "no completion after the fd fired");
	CHECK(ce.op_context == &rc, "fd completion context");
	FI(fi_close(&ep->fid));
	FI(fi_close(&cq->fid));
	puts("ok sread_and_wait_fd");
}

static void t_av(void)
{
	char name[64], str[128];
	size_t len = sizeof(name), slen = sizeof(str);
	FI(fi_av_lookup(av, addr_b, name, &len));
	CHECK(len > 0 && len <= sizeof(name), "lookup len %zu", len);
	fi_av_straddr(av, name, str, &slen);
	CHECK(!strncmp(str, "udp://", 6), "straddr %s", str);
	CHECK(fi_av_lookup(av, 999, name, &len) == -FI_EINVAL, "bad index");
	printf("ok av (%s)\n", str);
}

int main(void)
{
	setup();
	t_tagged_source_data();
	t_truncation();
	t_cancel();
	t_peek_claim_discard();
	t_inject_completion_and_selective();
	t_directed_and_zero();
	t_sread_and_wait_fd();
	t_av();
	FI(fi_close(&a.ep->fid));
	FI(fi_close(&b.ep->fid));
	if (a.txcq != a.rxcq)
		FI(fi_close(&a.txcq->fid));
	FI(fi_close(&a.rxcq->fid));
	FI(fi_close(&b.rxcq->fid));
	FI(fi_close(&av->fid));
	FI(fi_close(&domain->fid));
	FI(fi_close(&fabric->fid));
	fi_freeinfo(info);
	puts("ALL-OK");
	return 0;
}
