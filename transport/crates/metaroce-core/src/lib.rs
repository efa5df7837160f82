//! The MetaRoCE protocol core: a pure state machine. No sockets, no threads, no
//! clock: the driver hands it datagrams and the time, and asks it for datagrams
//! to send and for the next time it must be woken. `transport/PROTOCOL.md`
//! describes the protocol this implements.

pub mod buf;
pub mod congestion;
pub mod connection;
pub mod cookie;
pub mod counters;
pub mod endpoint;
pub mod event;
pub mod matching;
pub mod path;
pub mod sack;
pub mod time;
pub mod wire;

pub use buf::{RecvBuf, SendBuf};
pub use counters::Counters;
pub use endpoint::{Config, Endpoint, PathStats, Transmit};
pub use event::{Completion, Error, OpKind, PeekInfo, PeerId, ANY_PEER};
