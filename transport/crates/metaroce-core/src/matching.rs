//! Tag matching across the whole endpoint: receives posted by the application,
//! and messages that arrived (or announced themselves) before a receive matched.
//! Both queues are searched in order, so the earliest posted receive wins and
//! messages of one sender match in the order they were sent.

use std::collections::VecDeque;

use crate::buf::RecvBuf;
use crate::event::{PeerId, ANY_PEER};

#[derive(Debug)]
pub struct PostedRecv {
    pub context: u64,
    pub peer: PeerId,
    pub tag: u64,
    pub ignore: u64,
    pub tagged: bool,
    pub buf: RecvBuf,
    pub completion: bool,
}

/// A message that matched no receive yet; its data (if eager) stays with its connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unexpected {
    pub conn: u64,
    pub msg: u32,
    pub peer: PeerId,
    pub tag: u64,
    pub tagged: bool,
    pub len: u64,
    pub cq_data: Option<u64>,
    pub claimed_by: Option<u64>,
}

pub fn tag_matches(want_peer: PeerId, tag: u64, ignore: u64, tagged: bool, msg_peer: PeerId, msg_tag: u64, msg_tagged: bool) -> bool {
    if tagged != msg_tagged || (want_peer != ANY_PEER && want_peer != msg_peer) {
        return false;
    }
    !tagged || (tag & !ignore) == (msg_tag & !ignore)
}

#[derive(Debug, Default)]
pub struct Matcher {
    posted: VecDeque<PostedRecv>,
    unexpected: VecDeque<Unexpected>,
}

impl Matcher {
    /// The earliest posted receive that takes this message.
    pub fn take_posted(&mut self, peer: PeerId, tag: u64, tagged: bool) -> Option<PostedRecv> {
        let i = self.posted.iter().position(|r| tag_matches(r.peer, r.tag, r.ignore, r.tagged, peer, tag, tagged))?;
        self.posted.remove(i)
    }

    pub fn post(&mut self, r: PostedRecv) {
        self.posted.push_back(r);
    }

    pub fn push_unexpected(&mut self, u: Unexpected) {
        self.unexpected.push_back(u);
    }

    /// The earliest unclaimed message a receive with these criteria takes.
    pub fn take_unexpected(&mut self, peer: PeerId, tag: u64, ignore: u64, tagged: bool) -> Option<Unexpected> {
        let i = self
            .unexpected
            .iter()
            .position(|u| u.claimed_by.is_none() && tag_matches(peer, tag, ignore, tagged, u.peer, u.tag, u.tagged))?;
        self.unexpected.remove(i)
    }

    pub fn peek(&mut self, peer: PeerId, tag: u64, ignore: u64, tagged: bool) -> Option<&mut Unexpected> {
        self.unexpected.iter_mut().find(|u| u.claimed_by.is_none() && tag_matches(peer, tag, ignore, tagged, u.peer, u.tag, u.tagged))
    }

    pub fn take_claimed(&mut self, context: u64) -> Option<Unexpected> {
        let i = self.unexpected.iter().position(|u| u.claimed_by == Some(context))?;
        self.unexpected.remove(i)
    }

    pub fn cancel(&mut self, context: u64) -> Option<PostedRecv> {
        let i = self.posted.iter().position(|r| r.context == context)?;
        self.posted.remove(i)
    }

    /// Forget the unexpected messages of a connection that is gone.
    pub fn drop_conn(&mut self, conn: u64) {
        self.unexpected.retain(|u| u.conn != conn);
    }

    pub fn posted_len(&self) -> usize {
        self.posted.len()
    }

    pub fn unexpected_len(&self) -> usize {
        self.unexpected.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(ctx: u64, peer: PeerId, tag: u64, ignore: u64) -> PostedRecv {
        PostedRecv { context: ctx, peer, tag, ignore, tagged: true, buf: RecvBuf::owned(0), completion: true }
    }

    #[test]
    fn earliest_posted_matching_receive_wins() {
        let mut m = Matcher::default();
        m.post(recv(1, 7, 0x10, 0));
        m.post(recv(2, ANY_PEER, 0x10, 0x0f));
        m.post(recv(3, ANY_PEER, 0x10, 0));
        assert_eq!(m.take_posted(8, 0x10, true).unwrap().context, 2, "peer 8 is not 7");
        assert_eq!(m.take_posted(7, 0x10, true).unwrap().context, 1);
        assert!(m.take_posted(7, 0x10, false).is_none(), "untagged never matches tagged");
        assert_eq!(m.take_posted(7, 0x10, true).unwrap().context, 3);
    }

    #[test]
    fn claimed_messages_are_invisible_until_taken_by_context() {
        let mut m = Matcher::default();
        let u = Unexpected { conn: 1, msg: 0, peer: 1, tag: 5, tagged: true, len: 3, cq_data: None, claimed_by: None };
        m.push_unexpected(u);
        m.peek(ANY_PEER, 5, 0, true).unwrap().claimed_by = Some(99);
        assert!(m.peek(ANY_PEER, 5, 0, true).is_none());
        assert!(m.take_unexpected(ANY_PEER, 5, 0, true).is_none());
        assert_eq!(m.take_claimed(99).unwrap().msg, 0);
    }
}
