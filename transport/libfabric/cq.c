/*
 * cq.c: completion queues.
 *
 * A CQ is a FIFO of provider completions. Reading it first drains every
 * endpoint bound to it (mr_poll), which routes each transport completion to
 * that endpoint's transmit or receive CQ -- possibly another CQ, which is
 * then woken through its eventfd. Successful entries are returned up to the
 * first error; an error at the head makes fi_cq_read return -FI_EAVAIL and
 * fi_cq_readerr return it (FI_ETRUNC with olen, FI_ECANCELED, FI_ENOMSG for
 * an FI_PEEK that found nothing, transport errors such as FI_ETIMEDOUT).
 *
 * Waiting: fi_cq_sread polls the endpoints' mr_ep_fd and the CQ's eventfd;
 * FI_WAIT_FD hands out an epoll fd over the same set (use fi_trywait first,
 * as libfabric requires).
 */
#include <poll.h>
#include <stdlib.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "mrfi.h"

/* ---- FIFO (q_lock held) ---- */

static struct mrfi_cqe *q_at(struct mrfi_cq *cq, size_t i)
{
	return &cq->q[(cq->q_head + i) & (cq->q_cap - 1)];
}

static int q_grow(struct mrfi_cq *cq)
{
	size_t cap = cq->q_cap * 2;
	struct mrfi_cqe *q = malloc(cap * sizeof(*q));
	if (!q)
		return -FI_ENOMEM;
	for (size_t i = 0; i < cq->q_len; i++)
		q[i] = *q_at(cq, i);
	free(cq->q);
	cq->q = q;
	cq->q_cap = cap;
	cq->q_head = 0;
	return 0;
}

static void q_pop(struct mrfi_cq *cq)
{
	cq->q_head = (cq->q_head + 1) & (cq->q_cap - 1);
	cq->q_len--;
}

static void signal_reset(struct mrfi_cq *cq)
{
	uint64_t v;
	if (cq->signaled && !cq->q_len) {
		if (read(cq->signal_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
			MRFI_DBG(FI_LOG_CQ, "eventfd read: %s\n", strerror(errno));
		cq->signaled = false;
	}
}

static void signal_set(struct mrfi_cq *cq)
{
	uint64_t one = 1;
	if (!cq->signaled) {
		if (write(cq->signal_fd, &one, sizeof(one)) < 0)
			MRFI_DBG(FI_LOG_CQ, "eventfd write: %s\n", strerror(errno));
		cq->signaled = true;
	}
}

void mrfi_cq_push(struct mrfi_cq *cq, const struct mrfi_cqe *e,
		  const struct mrfi_cq *poller)
{
	pthread_mutex_lock(&cq->q_lock);
	if (cq->q_len == cq->q_cap && q_grow(cq)) {
		pthread_mutex_unlock(&cq->q_lock);
		MRFI_WARN(FI_LOG_CQ, "out of memory: completion of context %p "
			  "dropped\n", e->op_context);
		return;
	}
	*q_at(cq, cq->q_len) = *e;
	cq->q_len++;
	/* Wake a reader blocked on this CQ (in fi_cq_sread, or on the FI_WAIT_FD
	 * fd); a CQ that is reading itself needs no wake-up. */
	if (cq != poller && (cq->wait_obj == FI_WAIT_FD ||
			     __atomic_load_n(&cq->waiters, __ATOMIC_ACQUIRE)))
		signal_set(cq);
	pthread_mutex_unlock(&cq->q_lock);
}

/* ---- endpoints bound to the CQ ---- */

int mrfi_cq_add_ep(struct mrfi_cq *cq, struct mrfi_ep *ep)
{
	int rc = 0;
	pthread_mutex_lock(&cq->eps_lock);
	for (size_t i = 0; i < cq->neps; i++)
		if (cq->eps[i] == ep)
			goto out;
	if (cq->neps == cq->cap_eps) {
		size_t cap = cq->cap_eps ? cq->cap_eps * 2 : 4;
		struct mrfi_ep **e = realloc(cq->eps, cap * sizeof(*e));
		if (!e) {
			rc = -FI_ENOMEM;
			goto out;
		}
		cq->eps = e;
		cq->cap_eps = cap;
	}
	cq->eps[cq->neps++] = ep;
	if (cq->epoll_fd >= 0 && ep->fd >= 0) {
		struct epoll_event ev = {.events = EPOLLIN, .data.ptr = ep};
		if (epoll_ctl(cq->epoll_fd, EPOLL_CTL_ADD, ep->fd, &ev) &&
		    errno != EEXIST)
			MRFI_WARN(FI_LOG_CQ, "epoll_ctl: %s\n", strerror(errno));
	}
out:
	pthread_mutex_unlock(&cq->eps_lock);
	return rc;
}

void mrfi_cq_remove_ep(struct mrfi_cq *cq, struct mrfi_ep *ep)
{
	pthread_mutex_lock(&cq->eps_lock);
	for (size_t i = 0; i < cq->neps; i++) {
		if (cq->eps[i] == ep) {
			cq->eps[i] = cq->eps[--cq->neps];
			if (cq->epoll_fd >= 0 && ep->fd >= 0)
				epoll_ctl(cq->epoll_fd, EPOLL_CTL_DEL, ep->fd, NULL);
			break;
		}
	}
	pthread_mutex_unlock(&cq->eps_lock);
}

/* Drain every bound endpoint. Returns a transport error if one failed. */
static int cq_progress(struct mrfi_cq *cq)
{
	int rc = 0;
	pthread_mutex_lock(&cq->eps_lock);
	for (size_t i = 0; i < cq->neps; i++) {
		int r = mrfi_ep_progress(cq->eps[i], cq);
		if (r && !rc)
			rc = r;
	}
	pthread_mutex_unlock(&cq->eps_lock);
	return rc;
}

/* ---- reading ---- */

static void write_entry(const struct mrfi_cq *cq, void *buf, size_t i,
			const struct mrfi_cqe *e)
{
	switch (cq->format) {
	case FI_CQ_FORMAT_CONTEXT: {
		struct fi_cq_entry *o = (struct fi_cq_entry *)buf + i;
		o->op_context = e->op_context;
		break;
	}
	case FI_CQ_FORMAT_MSG: {
		struct fi_cq_msg_entry *o = (struct fi_cq_msg_entry *)buf + i;
		o->op_context = e->op_context;
		o->flags = e->flags;
		o->len = e->len;
		break;
	}
	case FI_CQ_FORMAT_DATA: {
		struct fi_cq_data_entry *o = (struct fi_cq_data_entry *)buf + i;
		o->op_context = e->op_context;
		o->flags = e->flags;
		o->len = e->len;
		o->buf = e->buf;
		o->data = e->data;
		break;
	}
	default: {
		struct fi_cq_tagged_entry *o = (struct fi_cq_tagged_entry *)buf + i;
		o->op_context = e->op_context;
		o->flags = e->flags;
		o->len = e->len;
		o->buf = e->buf;
		o->data = e->data;
		o->tag = e->tag;
		break;
	}
	}
}

static ssize_t cq_readfrom(struct fid_cq *fid, void *buf, size_t count,
			   fi_addr_t *src_addr)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;
	ssize_t n = 0;
	int prc = 0;

	pthread_mutex_lock(&cq->q_lock);
	bool enough = cq->q_len >= count;
	pthread_mutex_unlock(&cq->q_lock);
	if (!enough)
		prc = cq_progress(cq);

	pthread_mutex_lock(&cq->q_lock);
	while ((size_t)n < count && cq->q_len) {
		struct mrfi_cqe *e = q_at(cq, 0);
		if (e->err)
			break;
		write_entry(cq, buf, (size_t)n, e);
		if (src_addr)
			src_addr[n] = e->src;
		q_pop(cq);
		n++;
	}
	if (!n && cq->q_len)
		n = -FI_EAVAIL;
	else if (!n)
		n = prc ? prc : -FI_EAGAIN;
	signal_reset(cq);
	pthread_mutex_unlock(&cq->q_lock);
	return n;
}

static ssize_t cq_read(struct fid_cq *fid, void *buf, size_t count)
{
	return cq_readfrom(fid, buf, count, NULL);
}

static ssize_t cq_readerr(struct fid_cq *fid, struct fi_cq_err_entry *buf,
			  uint64_t flags)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;
	struct mrfi_cqe e;

	(void)flags;
	pthread_mutex_lock(&cq->q_lock);
	bool empty = !cq->q_len;
	pthread_mutex_unlock(&cq->q_lock);
	if (empty)
		cq_progress(cq);

	pthread_mutex_lock(&cq->q_lock);
	if (!cq->q_len || !q_at(cq, 0)->err) {
		pthread_mutex_unlock(&cq->q_lock);
		return -FI_EAGAIN;
	}
	e = *q_at(cq, 0);
	q_pop(cq);
	signal_reset(cq);
	pthread_mutex_unlock(&cq->q_lock);

	struct fi_cq_err_entry ee = {
		.op_context = e.op_context,
		.flags = e.flags,
		.len = e.len,
		.buf = e.buf,
		.data = e.data,
		.tag = e.tag,
		.olen = e.olen,
		.err = e.err,
		.prov_errno = e.prov_errno,
		.err_data = NULL,
		.err_data_size = 0,
	};
	if (FI_VERSION_LT(cq->api_version, FI_VERSION(1, 5))) {
		/* The 1.0 layout ends before err_data_size. */
		memcpy(buf, &ee, offsetof(struct fi_cq_err_entry, err_data_size));
	} else {
		void *user_err_data = buf->err_data;
		size_t user_size = buf->err_data_size;
		*buf = ee;
		if (user_size) /* caller's own buffer: nothing copied into it */
			buf->err_data = user_err_data;
	}
	return 1;
}

static int64_t now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static ssize_t cq_sreadfrom(struct fid_cq *fid, void *buf, size_t count,
			    fi_addr_t *src_addr, const void *cond, int timeout)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;
	int64_t deadline = timeout >= 0 ? now_ms() + timeout : -1;
	ssize_t n;
	(void)cond; /* a threshold is a hint: return as soon as one is there */

	/* Registered before the first read, so a completion another CQ's
	 * reader routes here after that read signals the eventfd. */
	__atomic_add_fetch(&cq->waiters, 1, __ATOMIC_ACQ_REL);
	for (;;) {
		n = cq_readfrom(fid, buf, count, src_addr);
		if (n != -FI_EAGAIN)
			break;
		if (__atomic_exchange_n(&cq->interrupted, false, __ATOMIC_ACQ_REL))
			break;
		int wait = -1;
		if (deadline >= 0) {
			int64_t left = deadline - now_ms();
			if (left <= 0)
				break;
			wait = (int)left;
		}

		struct pollfd fds[16];
		nfds_t nfds = 0;
		bool blind = false; /* an endpoint without a pollable fd */
		fds[nfds++] = (struct pollfd){.fd = cq->signal_fd, .events = POLLIN};
		pthread_mutex_lock(&cq->eps_lock);
		for (size_t i = 0; i < cq->neps; i++) {
			/* This reader blocks now: the progress thread takes over. */
			mr_progress_release(cq->eps[i]->mr);
			if (cq->eps[i]->fd < 0 || nfds == 16)
				blind = true;
			else
				fds[nfds++] = (struct pollfd){.fd = cq->eps[i]->fd,
							      .events = POLLIN};
		}
		pthread_mutex_unlock(&cq->eps_lock);
		if (blind && (wait < 0 || wait > 1))
			wait = 1;
		if (poll(fds, nfds, wait) < 0 && errno != EINTR) {
			n = -errno;
			break;
		}
	}
	__atomic_sub_fetch(&cq->waiters, 1, __ATOMIC_ACQ_REL);
	return n;
}

static ssize_t cq_sread(struct fid_cq *fid, void *buf, size_t count,
			const void *cond, int timeout)
{
	return cq_sreadfrom(fid, buf, count, NULL, cond, timeout);
}

static int cq_signal(struct fid_cq *fid)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;
	__atomic_store_n(&cq->interrupted, true, __ATOMIC_RELEASE);
	pthread_mutex_lock(&cq->q_lock);
	signal_set(cq);
	pthread_mutex_unlock(&cq->q_lock);
	return 0;
}

static const char *cq_strerror(struct fid_cq *fid, int prov_errno,
			       const void *err_data, char *buf, size_t len)
{
	const char *s = fi_strerror(prov_errno);
	(void)fid;
	(void)err_data;
	if (buf && len) {
		strncpy(buf, s, len - 1);
		buf[len - 1] = '\0';
		return buf;
	}
	return s;
}

int mrfi_cq_trywait(struct mrfi_cq *cq)
{
	cq_progress(cq);
	/* The application blocks on the wait fd next: hand progress back. */
	pthread_mutex_lock(&cq->eps_lock);
	for (size_t i = 0; i < cq->neps; i++)
		mr_progress_release(cq->eps[i]->mr);
	pthread_mutex_unlock(&cq->eps_lock);
	pthread_mutex_lock(&cq->q_lock);
	bool busy = cq->q_len != 0;
	if (!busy)
		signal_reset(cq);
	pthread_mutex_unlock(&cq->q_lock);
	return busy ? -FI_EAGAIN : 0;
}

static int cq_control(struct fid *fid, int command, void *arg)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;
	switch (command) {
	case FI_GETWAIT:
		if (cq->wait_obj != FI_WAIT_FD)
			return -FI_ENODATA;
		*(int *)arg = cq->epoll_fd;
		return 0;
	case FI_GETWAITOBJ:
		*(enum fi_wait_obj *)arg = cq->wait_obj;
		return 0;
	default:
		return -FI_ENOSYS;
	}
}

static int cq_close(struct fid *fid)
{
	struct mrfi_cq *cq = (struct mrfi_cq *)fid;

	pthread_mutex_lock(&cq->eps_lock);
	if (cq->refs) {
		pthread_mutex_unlock(&cq->eps_lock);
		return -FI_EBUSY;
	}
	pthread_mutex_unlock(&cq->eps_lock);
	if (cq->epoll_fd >= 0)
		close(cq->epoll_fd);
	if (cq->signal_fd >= 0)
		close(cq->signal_fd);
	pthread_mutex_destroy(&cq->eps_lock);
	pthread_mutex_destroy(&cq->q_lock);
	free(cq->eps);
	free(cq->q);
	mrfi_domain_ref(cq->domain, -1);
	free(cq);
	return 0;
}

static struct fi_ops cq_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = cq_close,
	.bind = mrfi_no_bind,
	.control = cq_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static struct fi_ops_cq cq_ops = {
	.size = sizeof(struct fi_ops_cq),
	.read = cq_read,
	.readfrom = cq_readfrom,
	.readerr = cq_readerr,
	.sread = cq_sread,
	.sreadfrom = cq_sreadfrom,
	.signal = cq_signal,
	.strerror = cq_strerror,
};

int mrfi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr,
		 struct fid_cq **out, void *context)
{
	struct mrfi_domain *d = (struct mrfi_domain *)domain;
	struct mrfi_cq *cq;
	size_t cap = 1024;

	switch (attr->format) {
	case FI_CQ_FORMAT_UNSPEC:
	case FI_CQ_FORMAT_CONTEXT:
	case FI_CQ_FORMAT_MSG:
	case FI_CQ_FORMAT_DATA:
	case FI_CQ_FORMAT_TAGGED:
		break;
	default:
		MRFI_WARN(FI_LOG_CQ, "CQ format %d not supported\n",
			  (int)attr->format);
		return -FI_ENOSYS;
	}
	switch (attr->wait_obj) {
	case FI_WAIT_NONE:
	case FI_WAIT_UNSPEC:
	case FI_WAIT_FD:
	case FI_WAIT_YIELD:
		break;
	default:
		MRFI_WARN(FI_LOG_CQ, "CQ wait_obj %d not supported (none, "
			  "unspec, fd, yield)\n", (int)attr->wait_obj);
		return -FI_ENOSYS;
	}
	if (attr->flags & FI_AFFINITY)
		MRFI_INFO(FI_LOG_CQ, "FI_AFFINITY ignored\n");

	cq = calloc(1, sizeof(*cq));
	if (!cq)
		return -FI_ENOMEM;
	while (cap < attr->size)
		cap *= 2;
	cq->q = malloc(cap * sizeof(*cq->q));
	cq->q_cap = cap;
	cq->signal_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
	cq->epoll_fd = -1;
	if (!cq->q || cq->signal_fd < 0)
		goto fail;
	if (attr->wait_obj == FI_WAIT_FD) {
		struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
		cq->epoll_fd = epoll_create1(EPOLL_CLOEXEC);
		if (cq->epoll_fd < 0 ||
		    epoll_ctl(cq->epoll_fd, EPOLL_CTL_ADD, cq->signal_fd, &ev))
			goto fail;
	}
	cq->domain = d;
	cq->format = attr->format == FI_CQ_FORMAT_UNSPEC ? FI_CQ_FORMAT_CONTEXT
							 : attr->format;
	cq->wait_obj = attr->wait_obj;
	cq->api_version = d->fabric->fabric_fid.api_version;
	pthread_mutex_init(&cq->eps_lock, NULL);
	pthread_mutex_init(&cq->q_lock, NULL);
	cq->cq_fid.fid.fclass = FI_CLASS_CQ;
	cq->cq_fid.fid.context = context;
	cq->cq_fid.fid.ops = &cq_fid_ops;
	cq->cq_fid.ops = &cq_ops;
	mrfi_domain_ref(d, 1);
	*out = &cq->cq_fid;
	return 0;
fail:
	if (cq->signal_fd >= 0)
		close(cq->signal_fd);
	if (cq->epoll_fd >= 0)
		close(cq->epoll_fd);
	free(cq->q);
	free(cq);
	return -FI_ENOMEM;
}
