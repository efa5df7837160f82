/*
 * msg.c: the FI_MSG operations, and the send and receive paths that the
 * tagged operations share.
 *
 * Completions: an operation writes a successful completion when a CQ is
 * bound for its direction and either the binding is not
 * FI_SELECTIVE_COMPLETION or the operation carries FI_COMPLETION (for the
 * non-msg calls: the endpoint's default op_flags). Errors are always
 * reported. fi_inject* never complete. A send completes once the receiver
 * has acknowledged every byte (FI_TRANSMIT_COMPLETE).
 */
#include <stdlib.h>

#include "mrfi.h"

int mrfi_iov_one(const struct iovec *iov, size_t count, void **buf,
		 size_t *len)
{
	if (count == 0) {
		*buf = NULL;
		*len = 0;
		return 0;
	}
	if (count > MRFI_IOV_LIMIT || !iov)
		return -FI_EINVAL; /* iov_limit is 1 */
	*buf = iov[0].iov_base;
	*len = iov[0].iov_len;
	return 0;
}

ssize_t mrfi_send(struct mrfi_ep *ep, const void *buf, size_t len,
		  fi_addr_t dest, uint64_t tag, uint64_t data, uint64_t flags,
		  void *context, bool tagged)
{
	struct mrfi_bounce *b = NULL;
	uint32_t mf = tagged ? MR_TAGGED : 0;
	mr_peer peer;
	bool want;
	int rc;

	if (!ep->enabled)
		return -FI_EOPBADSTATE;
	if (flags & (FI_DELIVERY_COMPLETE | FI_COMMIT_COMPLETE |
		     FI_MATCH_COMPLETE))
		return -FI_EBADFLAGS; /* transmit complete is the strongest */
	rc = mrfi_av_peer(ep, dest, &peer);
	if (rc)
		return rc;
	if (flags & FI_REMOTE_CQ_DATA)
		mf |= MR_REMOTE_CQ_DATA;
	want = ep->tx_cq && !(flags & MRFI_NO_COMPLETION) &&
	       (!ep->tx_selective || (flags & FI_COMPLETION));

	if (flags & FI_INJECT) {
		if (len > ep->max_inject)
			return -FI_EINVAL;
		if (!want) {
			mf |= MR_INJECT;
		} else {
			/* MR_INJECT never completes: copy the data instead. */
			b = mrfi_ep_bounce_get(ep);
			if (!b)
				return -FI_EAGAIN;
			b->copy = malloc(len ? len : 1);
			if (!b->copy) {
				mrfi_ep_bounce_put(ep, b);
				return -FI_ENOMEM;
			}
			memcpy(b->copy, buf, len);
			b->user_context = context;
			buf = b->copy;
			context = b;
		}
	} else if (!want) {
		mf |= MR_NO_COMPLETION;
	}
	rc = mr_send(ep->mr, peer, buf, len, tag, data, mf, context);
	if (rc && b)
		mrfi_ep_bounce_put(ep, b);
	if (rc && rc != -MR_EAGAIN)
		mrfi_log_last_error(FI_LOG_EP_DATA, "mr_send", rc);
	return mrfi_err(rc);
}

/* FI_PEEK: look for an unmatched message and report it on the RX CQ,
 * found (len, tag, data, source) or not (error FI_ENOMSG). */
static ssize_t peek(struct mrfi_ep *ep, mr_peer peer, uint64_t tag,
		    uint64_t ignore, uint64_t flags, void *context, bool tagged)
{
	struct mr_completion out = {0};
	struct mrfi_cqe e = {0};
	uint32_t mf = tagged ? MR_TAGGED : 0;
	int rc;

	if (!ep->rx_cq)
		return -FI_ENOCQ;
	/* The transport drops a match on MR_DISCARD without MR_CLAIM (with
	 * MR_CLAIM it would claim it). FI_PEEK|FI_CLAIM|FI_DISCARD is not a
	 * valid combination: discard wins. */
	if (flags & FI_DISCARD)
		mf |= MR_DISCARD;
	else if (flags & FI_CLAIM)
		mf |= MR_CLAIM;
	rc = mr_peek(ep->mr, peer, tag, ignore, mf, context, &out);
	e.op_context = context;
	e.flags = FI_RECV | (tagged ? FI_TAGGED : FI_MSG);
	e.src = FI_ADDR_NOTAVAIL;
	if (rc == 0) {
		e.len = (size_t)out.len;
		e.tag = out.tag;
		if (out.flags & MR_REMOTE_CQ_DATA) {
			e.flags |= FI_REMOTE_CQ_DATA;
			e.data = out.data;
		}
		e.src = mrfi_av_src(ep, out.peer);
	} else if (rc == -MR_ENOMSG) {
		e.err = FI_ENOMSG;
		e.prov_errno = MR_ENOMSG;
	} else {
		mrfi_log_last_error(FI_LOG_EP_DATA, "mr_peek", rc);
		return mrfi_err(rc);
	}
	mrfi_ep_push_rx(ep, &e);
	return 0;
}

ssize_t mrfi_recv(struct mrfi_ep *ep, void *buf, size_t len, fi_addr_t src,
		  uint64_t tag, uint64_t ignore, uint64_t flags, void *context,
		  bool tagged)
{
	mr_peer peer = MR_ANY_PEER;
	uint32_t mf = tagged ? MR_TAGGED : 0;
	bool want;
	int rc;

	if (!ep->enabled)
		return -FI_EOPBADSTATE;
	if (flags & FI_MULTI_RECV)
		return -FI_EBADFLAGS;
	/* Without FI_DIRECTED_RECV the source address is ignored, and so it is
	 * when taking a claimed message (the claim names the message). */
	bool claimed = (flags & FI_CLAIM) && !(flags & FI_PEEK);
	if ((ep->caps & FI_DIRECTED_RECV) && src != FI_ADDR_UNSPEC && !claimed) {
		rc = mrfi_av_peer(ep, src, &peer);
		if (rc)
			return rc;
	}
	if (flags & FI_PEEK)
		return peek(ep, peer, tag, ignore, flags, context, tagged);

	want = ep->rx_cq && (!ep->rx_selective || (flags & FI_COMPLETION));
	if (flags & FI_CLAIM) {
		mf |= MR_CLAIM;
		if (flags & FI_DISCARD)
			mf |= MR_DISCARD;
	}
	if (!want)
		mf |= MR_NO_COMPLETION;
	rc = mr_recv(ep->mr, peer, buf, len, tag, ignore, mf, context);
	if (rc && rc != -MR_EAGAIN)
		mrfi_log_last_error(FI_LOG_EP_DATA, "mr_recv", rc);
	return mrfi_err(rc);
}

/* ---- fi_ops_msg ---- */

static ssize_t msg_recv(struct fid_ep *fid, void *buf, size_t len, void *desc,
			fi_addr_t src_addr, void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_recv(ep, buf, len, src_addr, 0, 0,
			 ep->rx_op_flags & FI_COMPLETION, context, false);
}

static ssize_t msg_recvv(struct fid_ep *fid, const struct iovec *iov,
			 void **desc, size_t count, fi_addr_t src_addr,
			 void *context)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(iov, count, &buf, &len);
	if (rc)
		return rc;
	return msg_recv(fid, buf, len, desc ? desc[0] : NULL, src_addr, context);
}

static ssize_t msg_recvmsg(struct fid_ep *fid, const struct fi_msg *msg,
			   uint64_t flags)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(msg->msg_iov, msg->iov_count, &buf, &len);
	if (rc)
		return rc;
	/* FI_PEEK/FI_CLAIM/FI_DISCARD apply to tagged receives only. */
	if (flags & (FI_PEEK | FI_CLAIM | FI_DISCARD))
		return -FI_EBADFLAGS;
	return mrfi_recv(mrfi_ep_of(fid), buf, len, msg->addr, 0, 0, flags,
			 msg->context, false);
}

static ssize_t msg_send(struct fid_ep *fid, const void *buf, size_t len,
			void *desc, fi_addr_t dest_addr, void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_send(ep, buf, len, dest_addr, 0, 0,
			 ep->tx_op_flags & FI_COMPLETION, context, false);
}

static ssize_t msg_sendv(struct fid_ep *fid, const struct iovec *iov,
			 void **desc, size_t count, fi_addr_t dest_addr,
			 void *context)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(iov, count, &buf, &len);
	if (rc)
		return rc;
	return msg_send(fid, buf, len, desc ? desc[0] : NULL, dest_addr, context);
}

static ssize_t msg_sendmsg(struct fid_ep *fid, const struct fi_msg *msg,
			   uint64_t flags)
{
	void *buf;
	size_t len;
	int rc = mrfi_iov_one(msg->msg_iov, msg->iov_count, &buf, &len);
	if (rc)
		return rc;
	return mrfi_send(mrfi_ep_of(fid), buf, len, msg->addr, 0, msg->data,
			 flags, msg->context, false);
}

static ssize_t msg_inject(struct fid_ep *fid, const void *buf, size_t len,
			  fi_addr_t dest_addr)
{
	return mrfi_send(mrfi_ep_of(fid), buf, len, dest_addr, 0, 0,
			 FI_INJECT | MRFI_NO_COMPLETION, NULL, false);
}

static ssize_t msg_senddata(struct fid_ep *fid, const void *buf, size_t len,
			    void *desc, uint64_t data, fi_addr_t dest_addr,
			    void *context)
{
	struct mrfi_ep *ep = mrfi_ep_of(fid);
	(void)desc;
	return mrfi_send(ep, buf, len, dest_addr, 0, data,
			 (ep->tx_op_flags & FI_COMPLETION) | FI_REMOTE_CQ_DATA,
			 context, false);
}

static ssize_t msg_injectdata(struct fid_ep *fid, const void *buf, size_t len,
			      uint64_t data, fi_addr_t dest_addr)
{
	return mrfi_send(mrfi_ep_of(fid), buf, len, dest_addr, 0, data,
			 FI_INJECT | FI_REMOTE_CQ_DATA | MRFI_NO_COMPLETION,
			 NULL, false);
}

struct fi_ops_msg mrfi_msg_ops = {
	.size = sizeof(struct fi_ops_msg),
	.recv = msg_recv,
	.recvv = msg_recvv,
	.recvmsg = msg_recvmsg,
	.send = msg_send,
	.sendv = msg_sendv,
	.sendmsg = msg_sendmsg,
	.inject = msg_inject,
	.senddata = msg_senddata,
	.injectdata = msg_injectdata,
};
