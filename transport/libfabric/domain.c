/*
 * domain.c: the domain object and memory registration.
 *
 * The provider has no RMA, so no memory ever needs registering: fi_mr_reg
 * succeeds for applications that register anyway (mr_mode FI_MR_LOCAL
 * users) and returns a unique key and a NULL descriptor.
 */
#include <stdlib.h>

#include "mrfi.h"

void mrfi_domain_ref(struct mrfi_domain *d, int delta)
{
	pthread_mutex_lock(&d->lock);
	d->refs += delta;
	pthread_mutex_unlock(&d->lock);
}

/* ---- MR ---- */

static int mr_close(struct fid *fid)
{
	struct mrfi_mr *mr = (struct mrfi_mr *)fid;
	mrfi_domain_ref(mr->domain, -1);
	free(mr);
	return 0;
}

static int mr_control(struct fid *fid, int command, void *arg)
{
	(void)fid;
	(void)arg;
	return command == FI_ENABLE ? 0 : -FI_ENOSYS;
}

static int mr_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	(void)fid;
	(void)flags;
	/* FI_MR_ENDPOINT is never asked for; accept an endpoint bind anyway. */
	return bfid->fclass == FI_CLASS_EP ? 0 : -FI_EINVAL;
}

static struct fi_ops mr_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = mr_close,
	.bind = mr_bind,
	.control = mr_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static int mr_regattr(struct fid *fid, const struct fi_mr_attr *attr,
		      uint64_t flags, struct fid_mr **out)
{
	struct mrfi_domain *d = (struct mrfi_domain *)fid;
	struct mrfi_mr *mr;

	(void)flags;
	if (attr->iface != FI_HMEM_SYSTEM)
		return -FI_ENOSYS;
	if (attr->access & (FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE))
		MRFI_INFO(FI_LOG_MR, "MR access %#llx: no RMA, registration "
			  "is for local use only\n",
			  (unsigned long long)attr->access);
	mr = calloc(1, sizeof(*mr));
	if (!mr)
		return -FI_ENOMEM;
	mr->domain = d;
	mr->mr_fid.fid.fclass = FI_CLASS_MR;
	mr->mr_fid.fid.context = attr->context;
	mr->mr_fid.fid.ops = &mr_fid_ops;
	mr->mr_fid.mem_desc = NULL;
	pthread_mutex_lock(&d->lock);
	mr->mr_fid.key = d->next_key++;
	d->refs++;
	pthread_mutex_unlock(&d->lock);
	*out = &mr->mr_fid;
	return 0;
}

static int mr_regv(struct fid *fid, const struct iovec *iov, size_t count,
		   uint64_t access, uint64_t offset, uint64_t requested_key,
		   uint64_t flags, struct fid_mr **mr, void *context)
{
	struct fi_mr_attr attr = {
		.mr_iov = iov,
		.iov_count = count,
		.access = access,
		.offset = offset,
		.requested_key = requested_key,
		.context = context,
		.iface = FI_HMEM_SYSTEM,
	};
	return mr_regattr(fid, &attr, flags, mr);
}

static int mr_reg(struct fid *fid, const void *buf, size_t len,
		  uint64_t access, uint64_t offset, uint64_t requested_key,
		  uint64_t flags, struct fid_mr **mr, void *context)
{
	struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
	return mr_regv(fid, &iov, 1, access, offset, requested_key, flags, mr,
		       context);
}

static struct fi_ops_mr domain_mr_ops = {
	.size = sizeof(struct fi_ops_mr),
	.reg = mr_reg,
	.regv = mr_regv,
	.regattr = mr_regattr,
};

/* ---- domain ---- */

static int domain_close(struct fid *fid)
{
	struct mrfi_domain *d = (struct mrfi_domain *)fid;
	struct mrfi_fabric *f = d->fabric;

	pthread_mutex_lock(&d->lock);
	if (d->refs) {
		pthread_mutex_unlock(&d->lock);
		return -FI_EBUSY;
	}
	pthread_mutex_unlock(&d->lock);
	pthread_mutex_destroy(&d->lock);
	fi_freeinfo(d->info);
	free(d);
	pthread_mutex_lock(&f->lock);
	f->refs--;
	pthread_mutex_unlock(&f->lock);
	return 0;
}

static int domain_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	(void)fid;
	(void)flags;
	/* An EQ for asynchronous AV/MR events: never used, since both are
	 * synchronous here. */
	return bfid->fclass == FI_CLASS_EQ ? 0 : -FI_EINVAL;
}

static struct fi_ops domain_fid_ops = {
	.size = sizeof(struct fi_ops),
	.close = domain_close,
	.bind = domain_bind,
	.control = mrfi_no_control,
	.ops_open = mrfi_no_ops_open,
	.tostr = mrfi_no_tostr,
	.ops_set = mrfi_no_ops_set,
};

static int no_scalable_ep(struct fid_domain *domain, struct fi_info *info,
			  struct fid_ep **sep, void *context)
{
	(void)domain;
	(void)info;
	(void)sep;
	(void)context;
	return -FI_ENOSYS;
}

static int no_cntr_open(struct fid_domain *domain, struct fi_cntr_attr *attr,
			struct fid_cntr **cntr, void *context)
{
	(void)domain;
	(void)attr;
	(void)cntr;
	(void)context;
	return -FI_ENOSYS;
}

static int no_poll_open(struct fid_domain *domain, struct fi_poll_attr *attr,
			struct fid_poll **pollset)
{
	(void)domain;
	(void)attr;
	(void)pollset;
	return -FI_ENOSYS;
}

static int no_stx_ctx(struct fid_domain *domain, struct fi_tx_attr *attr,
		      struct fid_stx **stx, void *context)
{
	(void)domain;
	(void)attr;
	(void)stx;
	(void)context;
	return -FI_ENOSYS;
}

static int no_srx_ctx(struct fid_domain *domain, struct fi_rx_attr *attr,
		      struct fid_ep **rx_ep, void *context)
{
	(void)domain;
	(void)attr;
	(void)rx_ep;
	(void)context;
	return -FI_ENOSYS;
}

static int no_query_atomic(struct fid_domain *domain, enum fi_datatype datatype,
			   enum fi_op op, struct fi_atomic_attr *attr,
			   uint64_t flags)
{
	(void)domain;
	(void)datatype;
	(void)op;
	(void)attr;
	(void)flags;
	return -FI_EOPNOTSUPP;
}

static int no_query_collective(struct fid_domain *domain,
			       enum fi_collective_op coll,
			       struct fi_collective_attr *attr, uint64_t flags)
{
	(void)domain;
	(void)coll;
	(void)attr;
	(void)flags;
	return -FI_ENOSYS;
}

static int domain_endpoint2(struct fid_domain *domain, struct fi_info *info,
			    struct fid_ep **ep, uint64_t flags, void *context)
{
	if (flags)
		return -FI_EBADFLAGS;
	return mrfi_ep_open(domain, info, ep, context);
}

static struct fi_ops_domain domain_ops = {
	.size = sizeof(struct fi_ops_domain),
	.av_open = mrfi_av_open,
	.cq_open = mrfi_cq_open,
	.endpoint = mrfi_ep_open,
	.scalable_ep = no_scalable_ep,
	.cntr_open = no_cntr_open,
	.poll_open = no_poll_open,
	.stx_ctx = no_stx_ctx,
	.srx_ctx = no_srx_ctx,
	.query_atomic = no_query_atomic,
	.query_collective = no_query_collective,
	.endpoint2 = domain_endpoint2,
};

int mrfi_domain_open(struct fid_fabric *fabric, struct fi_info *info,
		     struct fid_domain **domain, void *context)
{
	struct mrfi_fabric *f = (struct mrfi_fabric *)fabric;
	struct mrfi_domain *d;

	if (!info || !info->domain_attr || !info->domain_attr->name ||
	    strcmp(info->domain_attr->name, MRFI_DOMAIN_NAME)) {
		MRFI_WARN(FI_LOG_DOMAIN, "fi_domain: info is not this "
			  "provider's (domain name must be %s)\n",
			  MRFI_DOMAIN_NAME);
		return -FI_EINVAL;
	}
	d = calloc(1, sizeof(*d));
	if (!d)
		return -FI_ENOMEM;
	d->info = fi_dupinfo(info);
	if (!d->info) {
		free(d);
		return -FI_ENOMEM;
	}
	pthread_mutex_init(&d->lock, NULL);
	d->fabric = f;
	d->next_key = 1;
	d->domain_fid.fid.fclass = FI_CLASS_DOMAIN;
	d->domain_fid.fid.context = context;
	d->domain_fid.fid.ops = &domain_fid_ops;
	d->domain_fid.ops = &domain_ops;
	d->domain_fid.mr = &domain_mr_ops;
	pthread_mutex_lock(&f->lock);
	f->refs++;
	pthread_mutex_unlock(&f->lock);
	*domain = &d->domain_fid;
	return 0;
}
