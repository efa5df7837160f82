//! What the core hands back to the application: completions and errors.

use crate::buf::RecvBuf;

pub type PeerId = u64;
pub const ANY_PEER: PeerId = u64::MAX;

/// Errors, with libfabric's (errno) numbers so the C ABI passes them through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Error {
    Again,
    Invalid,
    NoMem,
    NoEntry,
    NoMsg,
    Io,
    TimedOut,
    ConnReset,
    Canceled,
    Truncated,
}

impl Error {
    pub fn errno(self) -> i32 {
        match self {
            Self::Again => 11,
            Self::Invalid => 22,
            Self::NoMem => 12,
            Self::NoEntry => 2,
            Self::NoMsg => 42,
            Self::Io => 5,
            Self::TimedOut => 110,
            Self::ConnReset => 104,
            Self::Canceled => 125,
            Self::Truncated => 265,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    Send,
    Recv,
}

#[derive(Debug)]
pub struct Completion {
    pub context: u64,
    pub kind: OpKind,
    pub tagged: bool,
    pub cq_data: Option<u64>,
    pub err: Option<Error>,
    pub len: u64,
    pub tag: u64,
    pub peer: PeerId,
    pub olen: u64,
    /// The receive buffer, handed back (owned buffers: the data).
    pub buf: Option<RecvBuf>,
}

/// What a peek found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeekInfo {
    pub peer: PeerId,
    pub len: u64,
    pub tag: u64,
    pub tagged: bool,
    pub cq_data: Option<u64>,
}
