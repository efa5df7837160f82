/*
 * fabric.c: the fabric object and a minimal event queue.
 *
 * An RDM endpoint over the transport has no connection-management events,
 * so the EQ exists for applications that open one anyway (fi_pingpong does):
 * it accepts fi_eq_write of application events and returns them, and is
 * otherwise empty.
 */
#include <stdlib.h>
#include <time.h>

#include "mrfi.h"

/* ---- EQ ---- */

struct mrfi_eq_item {
	struct mrfi_eq_item *next;
	uint32_t event;
	size_t len;
	uint8_t data[];
};

struct mrfi_eq_impl {
	struct mrfi_eq eq;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct mrfi_eq_item *head, *tail;
};

static ssize_t eq_read(struct fid_eq *fid, uint32_t *event, void *buf,
		       size_t len, uint64_t flags)
{
	struct mrfi_eq_impl *q = (struct mrfi_eq_impl *)fid;
	struct mrfi_eq_item *it;
	ssize_t n;

	pthread_mutex_lock(&q->lock);
	it = q->head;
	if (!it) {
		pthread_mutex_unlock(&q->lock);
		return -FI_EAGAIN;
	}
	if (len < it->len) {
		pthread_mutex_unlock(&q->lock);
		return -FI_ETOOSMALL;
	}
	if (event)
		*event = it->event;
	memcpy(buf, it->data, it->len);
	n = (ssize_t)it->len;
	if (!(flags & FI_PEEK)) {
		q->head = it->next;
		if (!q->head)
			q->tail = NULL;
		free(it);
	}
	pthread_mutex_unlock(&q->lock);
	return n;
}

static ssize_t eq_readerr(struct fid_eq *fid, struct fi_eq_err_entry *buf,
			  uint64_t flags)
{
	(void)fid;
	(void)buf;
	(void)flags;
	return -FI_EAGAIN; /* the provider never reports EQ errors */
}

static ssize_t eq_write(struct fid_eq *fid, uint32_t event, const void *buf,
			size_t len, uint64_t flags)
{
	struct mrfi_eq_impl *q = (struct mrfi_eq_impl *)fid;
	struct mrfi_eq_item *it = malloc(sizeof(*it) + len);
	(void)flags;
	if (!it)
		return -FI_ENOMEM;
	it->next = NULL;
	it->event = event;
	it->len = len;
	memcpy(it->data, buf, len);
	pthread_mutex_lock(&q->lock);
	if (q->tail)
		q->tail->next = it;
	else
		q->head = it;
	q->tail = it;
	pthread_cond_broadcast(&q->cond);
	pthread_mutex_unlock(&q->lock);
	return (ssize_t)len;
}

static ssize_t eq_sread(struct fid_eq *fid, uint32_t *event, void *buf,
			size_t len, int timeout, uint64_t flags)
{
	struct mrfi_eq_impl *q = (struct mrfi_eq_impl *)fid;
	struct timespec deadline;

	clock_gettime(CLOCK_REALTIME, &deadline);
	if (timeout >= 0) {
		deadline.tv_sec += timeout / 1000;
		deadline.tv_nsec += (long)(timeout % 1000) * 1000000L;
		if (deadline.tv_nsec >= 1000000000L) {
			deadline.tv_sec++;
			deadline.tv_nsec -= 1000000000L;
		}
	}
	pthread_mutex_lock(&q->lock);
	while (!q->head) {
		int rc = timeout < 0 ? pthread_cond_wait(&q->cond, &q->lock)
				     : pthread_cond_timedwait(&q->cond, &q->lock,
							      &deadline);
		if (rc == ETIMEDOUT) {
			pthread_mutex_unlock(&q->lock);
			return -FI_EAGAIN;
		}
	}
	pthread_mutex_unlock(&q->lock);
	return eq_read(fid, event, buf, len, flags);
}

static const char *eq_strerror(struct fid_eq *fid, int prov_errno,
			       const void *err_data, char *buf, size_t len)
{
	const char *s = mr_strerror(prov_errno);
	(void)fid;
	(void)err_data;
	if (buf && len) {
		strncpy(buf, s, len - 1);
		buf[len - 1] = '\0';
		return buf;
	}
	return s;
}

static int eq_close(struct fid *fid)
{
	struct mrfi_eq_impl *q = (struct mrfi_eq_impl *)fid;
	struct mrfi_fabric *f = q->eq.fabric;
	while (q->head) {
		struct mrfi_eq_item *it = q->head;
		q->head = it->next;
		free(it);
	}
	pthread_mutex_destroy(&q->lock);
	pthread_cond_destroy(&q->cond);
	free(q);
	pthread_mutex_lock(&f->lock);
	f->refs--;
	pthread_mutex_unlock(&f->lock);
	return 0;
}

static struct fi_ops eq_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = eq_close,
	.bind = mrfi_no_bind,
	.control = mrfi_no_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static struct fi_ops_eq eq_ops = {
	.size = sizeof(struct fi_ops_eq),
	.read = eq_read,
	.readerr = eq_readerr,
	.write = eq_write,
	.sread = eq_sread,
	.strerror = eq_strerror,
};

static int eq_open(struct fid_fabric *fabric, struct fi_eq_attr *attr,
		   struct fid_eq **eq, void *context)
{
	struct mrfi_fabric *f = (struct mrfi_fabric *)fabric;
	struct mrfi_eq_impl *q;

	if (attr && attr->wait_obj != FI_WAIT_NONE &&
	    attr->wait_obj != FI_WAIT_UNSPEC &&
	    attr->wait_obj != FI_WAIT_MUTEX_COND) {
		MRFI_WARN(FI_LOG_EQ, "EQ wait_obj %d not supported (none, "
			  "unspec or mutex_cond)\n", (int)attr->wait_obj);
		return -FI_ENOSYS;
	}
	q = calloc(1, sizeof(*q));
	if (!q)
		return -FI_ENOMEM;
	pthread_mutex_init(&q->lock, NULL);
	pthread_cond_init(&q->cond, NULL);
	q->eq.fabric = f;
	q->eq.eq_fid.fid.fclass = FI_CLASS_EQ;
	q->eq.eq_fid.fid.context = context;
	q->eq.eq_fid.fid.ops = &eq_fid_ops;
	q->eq.eq_fid.ops = &eq_ops;
	pthread_mutex_lock(&f->lock);
	f->refs++;
	pthread_mutex_unlock(&f->lock);
	*eq = &q->eq.eq_fid;
	return 0;
}

/* ---- fabric ---- */

static int fabric_trywait(struct fid_fabric *fabric, struct fid **fids,
			  int count)
{
	(void)fabric;
	for (int i = 0; i < count; i++) {
		if (fids[i]->fclass == FI_CLASS_CQ) {
			int rc = mrfi_cq_trywait((struct mrfi_cq *)fids[i]);
			if (rc)
				return rc;
		} else if (fids[i]->fclass == FI_CLASS_EQ) {
			struct mrfi_eq_impl *q = (struct mrfi_eq_impl *)fids[i];
			pthread_mutex_lock(&q->lock);
			bool busy = q->head != NULL;
			pthread_mutex_unlock(&q->lock);
			if (busy)
				return -FI_EAGAIN;
		} else {
			return -FI_EINVAL;
		}
	}
	return 0;
}

static int fabric_domain2(struct fid_fabric *fabric, struct fi_info *info,
			  struct fid_domain **dom, uint64_t flags,
			  void *context)
{
	if (flags)
		return -FI_EBADFLAGS;
	return mrfi_domain_open(fabric, info, dom, context);
}

static int no_passive_ep(struct fid_fabric *fabric, struct fi_info *info,
			 struct fid_pep **pep, void *context)
{
	(void)fabric;
	(void)info;
	(void)pep;
	(void)context;
	return -FI_ENOSYS; /* RDM only: no connection-oriented endpoints */
}

static int no_wait_open(struct fid_fabric *fabric, struct fi_wait_attr *attr,
			struct fid_wait **waitset)
{
	(void)fabric;
	(void)attr;
	(void)waitset;
	return -FI_ENOSYS;
}

static int fabric_close(struct fid *fid)
{
	struct mrfi_fabric *f = (struct mrfi_fabric *)fid;
	pthread_mutex_lock(&f->lock);
	if (f->refs) {
		pthread_mutex_unlock(&f->lock);
		return -FI_EBUSY;
	}
	pthread_mutex_unlock(&f->lock);
	pthread_mutex_destroy(&f->lock);
	free(f);
	return 0;
}

static struct fi_ops fabric_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = fabric_close,
	.bind = mrfi_no_bind,
	.control = mrfi_no_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static struct fi_ops_fabric fabric_ops = {
	.size = sizeof(struct fi_ops_fabric),
	.domain = mrfi_domain_open,
	.passive_ep = no_passive_ep,
	.eq_open = eq_open,
	.wait_open = no_wait_open,
	.trywait = fabric_trywait,
	.domain2 = fabric_domain2,
};

int mrfi_fabric_open(struct fi_fabric_attr *attr, struct fid_fabric **fabric,
		     void *context)
{
	struct mrfi_fabric *f;

	if (attr && attr->name && strcmp(attr->name, MRFI_FABRIC_NAME))
		return -FI_ENODATA;
	f = calloc(1, sizeof(*f));
	if (!f)
		return -FI_ENOMEM;
	pthread_mutex_init(&f->lock, NULL);
	f->fabric_fid.fid.fclass = FI_CLASS_FABRIC;
	f->fabric_fid.fid.context = context;
	f->fabric_fid.fid.ops = &fabric_fid_ops;
	f->fabric_fid.ops = &fabric_ops;
	/* libfabric's core sets api_version after this returns. */
	f->fabric_fid.api_version = attr ? attr->api_version : MRFI_FI_VERSION;
	*fabric = &f->fabric_fid;
	return 0;
}
