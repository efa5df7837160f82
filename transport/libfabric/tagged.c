/*
 * tagged.c: the FI_TAGGED operations.
 *
 * Matching is the transport's: a message matches a receive when
 * (msg_tag & ~ignore) == (tag & ~ignore) and, with FI_DIRECTED_RECV, the
 * source matches (FI_ADDR_UNSPEC: any); the earliest posted matching receive
 * wins; messages between two endpoints match in send order (FI_ORDER_SAS).
 *
 * fi_trecvmsg flags, per fi_tagged(3):
 *   FI_PEEK            report an unmatched message on the CQ without
 *                      receiving it (len, tag, cq data, source); a miss
 *                      completes with error FI_ENOMSG;
 *   FI_PEEK|FI_CLAIM   and hold it for this context (MPI_Improbe);
 *   FI_CLAIM           receive the message claimed with this context
 *                      (MPI_Imrecv); tag, ignore and source are ignored;
 *   FI_PEEK|FI_DISCARD drop a matching message once it is reported;
 *   FI_CLAIM|FI_DISCARD drop the message claimed with this context.
 */
#include "mrfi.h"

static ssize_t t_recv(struct fid_ep *fid, void *buf, size_t len, void *desc,
		      fi_addr_t src_addr, uint64_t tag, uint64_t ignore,
		      void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_recv(ep, buf, len, src_addr, tag, ignore,
			 ep->rx_op_flags & FI_COMPLETION, context, true);
}

static ssize_t t_recvv(struct fid_ep *fid, const struct iovec *iov,
		       void **desc, size_t count, fi_addr_t src_addr,
		       uint64_t tag, uint64_t ignore, void *context)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(iov, count, &buf, &len);
	if (rc)
		return rc;
	return t_recv(fid, buf, len, desc ? desc[0] : NULL, src_addr, tag,
		      ignore, context);
}

static ssize_t t_recvmsg(struct fid_ep *fid, const struct fi_msg_tagged *msg,
			 uint64_t flags)
{
	void *buf = NULL;
	size_t len = 0;
	int rc;

	/* A claimed or discarded message needs no (or ignores the) buffer. */
	if (!(flags & (FI_PEEK | FI_DISCARD))) {
		rc = mrfi_iov_one(msg->msg_iov, msg->iov_count, &buf, &len);
		if (rc)
			return rc;
	}
	return mrfi_recv(mrfi_ep_of(fid), buf, len, msg->addr, msg->tag,
			 msg->ignore, flags, msg->context, true);
}

static ssize_t t_send(struct fid_ep *fid, const void *buf, size_t len,
		      void *desc, fi_addr_t dest_addr, uint64_t tag,
		      void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_send(ep, buf, len, dest_addr, tag, 0,
			 ep->tx_op_flags & FI_COMPLETION, context, true);
}

static ssize_t t_sendv(struct fid_ep *fid, const struct iovec *iov,
		       void **desc, size_t count, fi_addr_t dest_addr,
		       uint64_t tag, void *context)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(iov, count, &buf, &len);
	if (rc)
		return rc;
	return t_send(fid, buf, len, desc ? desc[0] : NULL, dest_addr, tag,
		      context);
}

static ssize_t t_sendmsg(struct fid_ep *fid, const struct fi_msg_tagged *msg,
			 uint64_t flags)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(msg->msg_iov, msg->iov_count, &buf, &len);
	if (rc)
		return rc;
	return mrfi_send(mrfi_ep_of(fid), buf, len, msg->addr, msg->tag,
			 msg->data, flags, msg->context, true);
}

static ssize_t t_inject(struct fid_ep *fid, const void *buf, size_t len,
			fi_addr_t dest_addr, uint64_t tag)
{
	return mrfi_send(mrfi_ep_of(fid), buf, len, dest_addr, tag, 0,
			 FI_INJECT | MRFI_NO_COMPLETION, NULL, true);
}

static ssize_t t_senddata(struct fid_ep *fid, const void *buf, size_t len,
			  void *desc, uint64_t data, fi_addr_t dest_addr,
			  uint64_t tag, void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_send(ep, buf, len, dest_addr, tag, data,
			 (ep->tx_op_flags & FI_COMPLETION) | FI_REMOTE_CQ_DATA,
			 context, true);
}

static ssize_t t_injectdata(struct fid_ep *fid, const void *buf, size_t len,
			    uint64_t data, fi_addr_t dest_addr, uint64_t tag)
{
	return mrfi_send(mrfi_ep_of(fid), buf, len, dest_addr, tag, data,
			 FI_INJECT | FI_REMOTE_CQ_DATA | MRFI_NO_COMPLETION,
			 NULL, true);
}

struct fi_ops_tagged mrfi_tagged_ops = {
	.size = sizeof(struct fi_ops_tagged),
	.recv = t_recv,
	.recvv = t_recvv,
	.recvmsg = t_recvmsg,
	.send = t_send,
	.sendv = t_sendv,
	.sendmsg = t_sendmsg,
	.inject = t_inject,
	.senddata = t_senddata,
	.injectdata = t_injectdata,
};
