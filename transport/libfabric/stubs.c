/*
 * stubs.c: operations the provider does not implement (RMA, atomics and
 * unused fid operations). Each returns -FI_ENOSYS so that a caller gets an
 * error instead of a NULL call; none of them is advertised.
 */
#include "mrfi.h"

#define UNUSED(x) (void)(x)

int mrfi_no_bind(struct fid *fid, struct fid *bfid, uint64_t flags)
{
	UNUSED(fid);
	UNUSED(bfid);
	UNUSED(flags);
	return -FI_ENOSYS;
}

int mrfi_no_control(struct fid *fid, int command, void *arg)
{
	UNUSED(fid);
	UNUSED(command);
	UNUSED(arg);
	return -FI_ENOSYS;
}

int mrfi_no_ops_open(struct fid *fid, const char *name, uint64_t flags,
		     void **ops, void *context)
{
	UNUSED(fid);
	UNUSED(name);
	UNUSED(flags);
	UNUSED(ops);
	UNUSED(context);
	return -FI_ENOSYS;
}

int mrfi_no_tostr(const struct fid *fid, char *buf, size_t len)
{
	UNUSED(fid);
	UNUSED(buf);
	UNUSED(len);
	return -FI_ENOSYS;
}

int mrfi_no_ops_set(struct fid *fid, const char *name, uint64_t flags,
		    void *ops, void *context)
{
	UNUSED(fid);
	UNUSED(name);
	UNUSED(flags);
	UNUSED(ops);
	UNUSED(context);
	return -FI_ENOSYS;
}

/* ---- RMA ---- */

static ssize_t rma_read(struct fid_ep *ep, void *buf, size_t len, void *desc,
			fi_addr_t src_addr, uint64_t addr, uint64_t key,
			void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(len); UNUSED(desc); UNUSED(src_addr);
	UNUSED(addr); UNUSED(key); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t rma_readv(struct fid_ep *ep, const struct iovec *iov,
			 void **desc, size_t count, fi_addr_t src_addr,
			 uint64_t addr, uint64_t key, void *context)
{
	UNUSED(ep); UNUSED(iov); UNUSED(desc); UNUSED(count); UNUSED(src_addr);
	UNUSED(addr); UNUSED(key); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t rma_readmsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
			   uint64_t flags)
{
	UNUSED(ep); UNUSED(msg); UNUSED(flags);
	return -FI_ENOSYS;
}

static ssize_t rma_write(struct fid_ep *ep, const void *buf, size_t len,
			 void *desc, fi_addr_t dest_addr, uint64_t addr,
			 uint64_t key, void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(len); UNUSED(desc); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t rma_writev(struct fid_ep *ep, const struct iovec *iov,
			  void **desc, size_t count, fi_addr_t dest_addr,
			  uint64_t addr, uint64_t key, void *context)
{
	UNUSED(ep); UNUSED(iov); UNUSED(desc); UNUSED(count); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t rma_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg,
			    uint64_t flags)
{
	UNUSED(ep); UNUSED(msg); UNUSED(flags);
	return -FI_ENOSYS;
}

static ssize_t rma_inject(struct fid_ep *ep, const void *buf, size_t len,
			  fi_addr_t dest_addr, uint64_t addr, uint64_t key)
{
	UNUSED(ep); UNUSED(buf); UNUSED(len); UNUSED(dest_addr); UNUSED(addr);
	UNUSED(key);
	return -FI_ENOSYS;
}

static ssize_t rma_writedata(struct fid_ep *ep, const void *buf, size_t len,
			     void *desc, uint64_t data, fi_addr_t dest_addr,
			     uint64_t addr, uint64_t key, void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(len); UNUSED(desc); UNUSED(data);
	UNUSED(dest_addr); UNUSED(addr); UNUSED(key); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t rma_injectdata(struct fid_ep *ep, const void *buf, size_t len,
			      uint64_t data, fi_addr_t dest_addr, uint64_t addr,
			      uint64_t key)
{
	UNUSED(ep); UNUSED(buf); UNUSED(len); UNUSED(data); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key);
	return -FI_ENOSYS;
}

struct fi_ops_rma mrfi_no_rma_ops = {
	.size = sizeof(struct fi_ops_rma),
	.read = rma_read,
	.readv = rma_readv,
	.readmsg = rma_readmsg,
	.write = rma_write,
	.writev = rma_writev,
	.writemsg = rma_writemsg,
	.inject = rma_inject,
	.writedata = rma_writedata,
	.injectdata = rma_injectdata,
};

/* ---- atomics ---- */

static ssize_t at_write(struct fid_ep *ep, const void *buf, size_t count,
			void *desc, fi_addr_t dest_addr, uint64_t addr,
			uint64_t key, enum fi_datatype datatype, enum fi_op op,
			void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(count); UNUSED(desc); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(datatype); UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_writev(struct fid_ep *ep, const struct fi_ioc *iov,
			 void **desc, size_t count, fi_addr_t dest_addr,
			 uint64_t addr, uint64_t key, enum fi_datatype datatype,
			 enum fi_op op, void *context)
{
	UNUSED(ep); UNUSED(iov); UNUSED(desc); UNUSED(count); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(datatype); UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_writemsg(struct fid_ep *ep, const struct fi_msg_atomic *msg,
			   uint64_t flags)
{
	UNUSED(ep); UNUSED(msg); UNUSED(flags);
	return -FI_ENOSYS;
}

static ssize_t at_inject(struct fid_ep *ep, const void *buf, size_t count,
			 fi_addr_t dest_addr, uint64_t addr, uint64_t key,
			 enum fi_datatype datatype, enum fi_op op)
{
	UNUSED(ep); UNUSED(buf); UNUSED(count); UNUSED(dest_addr); UNUSED(addr);
	UNUSED(key); UNUSED(datatype); UNUSED(op);
	return -FI_ENOSYS;
}

static ssize_t at_readwrite(struct fid_ep *ep, const void *buf, size_t count,
			    void *desc, void *result, void *result_desc,
			    fi_addr_t dest_addr, uint64_t addr, uint64_t key,
			    enum fi_datatype datatype, enum fi_op op,
			    void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(count); UNUSED(desc); UNUSED(result);
	UNUSED(result_desc); UNUSED(dest_addr); UNUSED(addr); UNUSED(key);
	UNUSED(datatype); UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_readwritev(struct fid_ep *ep, const struct fi_ioc *iov,
			     void **desc, size_t count, struct fi_ioc *resultv,
			     void **result_desc, size_t result_count,
			     fi_addr_t dest_addr, uint64_t addr, uint64_t key,
			     enum fi_datatype datatype, enum fi_op op,
			     void *context)
{
	UNUSED(ep); UNUSED(iov); UNUSED(desc); UNUSED(count); UNUSED(resultv);
	UNUSED(result_desc); UNUSED(result_count); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(datatype); UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_readwritemsg(struct fid_ep *ep,
			       const struct fi_msg_atomic *msg,
			       struct fi_ioc *resultv, void **result_desc,
			       size_t result_count, uint64_t flags)
{
	UNUSED(ep); UNUSED(msg); UNUSED(resultv); UNUSED(result_desc);
	UNUSED(result_count); UNUSED(flags);
	return -FI_ENOSYS;
}

static ssize_t at_compwrite(struct fid_ep *ep, const void *buf, size_t count,
			    void *desc, const void *compare,
			    void *compare_desc, void *result,
			    void *result_desc, fi_addr_t dest_addr,
			    uint64_t addr, uint64_t key,
			    enum fi_datatype datatype, enum fi_op op,
			    void *context)
{
	UNUSED(ep); UNUSED(buf); UNUSED(count); UNUSED(desc); UNUSED(compare);
	UNUSED(compare_desc); UNUSED(result); UNUSED(result_desc);
	UNUSED(dest_addr); UNUSED(addr); UNUSED(key); UNUSED(datatype);
	UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_compwritev(struct fid_ep *ep, const struct fi_ioc *iov,
			     void **desc, size_t count,
			     const struct fi_ioc *comparev,
			     void **compare_desc, size_t compare_count,
			     struct fi_ioc *resultv, void **result_desc,
			     size_t result_count, fi_addr_t dest_addr,
			     uint64_t addr, uint64_t key,
			     enum fi_datatype datatype, enum fi_op op,
			     void *context)
{
	UNUSED(ep); UNUSED(iov); UNUSED(desc); UNUSED(count); UNUSED(comparev);
	UNUSED(compare_desc); UNUSED(compare_count); UNUSED(resultv);
	UNUSED(result_desc); UNUSED(result_count); UNUSED(dest_addr);
	UNUSED(addr); UNUSED(key); UNUSED(datatype); UNUSED(op); UNUSED(context);
	return -FI_ENOSYS;
}

static ssize_t at_compwritemsg(struct fid_ep *ep,
			       const struct fi_msg_atomic *msg,
			       const struct fi_ioc *comparev,
			       void **compare_desc, size_t compare_count,
			       struct fi_ioc *resultv, void **result_desc,
			       size_t result_count, uint64_t flags)
{
	UNUSED(ep); UNUSED(msg); UNUSED(comparev); UNUSED(compare_desc);
	UNUSED(compare_count); UNUSED(resultv); UNUSED(result_desc);
	UNUSED(result_count); UNUSED(flags);
	return -FI_ENOSYS;
}

static int at_valid(struct fid_ep *ep, enum fi_datatype datatype,
		    enum fi_op op, size_t *count)
{
	UNUSED(ep); UNUSED(datatype); UNUSED(op); UNUSED(count);
	return -FI_EOPNOTSUPP;
}

struct fi_ops_atomic mrfi_no_atomic_ops = {
	.size = sizeof(struct fi_ops_atomic),
	.write = at_write,
	.writev = at_writev,
	.writemsg = at_writemsg,
	.inject = at_inject,
	.readwrite = at_readwrite,
	.readwritev = at_readwritev,
	.readwritemsg = at_readwritemsg,
	.compwrite = at_compwrite,
	.compwritev = at_compwritev,
	.compwritemsg = at_compwritemsg,
	.writevalid = at_valid,
	.readwritevalid = at_valid,
	.compwritevalid = at_valid,
};
