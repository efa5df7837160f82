//! The MetaRoCE transport over UDP: `metaroce-core` on real sockets with a
//! progress thread (`transport`), its configuration (`config`), the sockets
//! (`udp`), the stats file (`stats`), goodput binned by kernel arrival time
//! (`arrival`, for metaroce-perf) and the C ABI of `include/metaroce.h` (`ffi`).

pub mod addr;
pub mod arrival;
pub mod config;
pub mod ffi;
pub mod stats;
pub mod transport;
pub mod udp;

pub use metaroce_core::{Completion, Counters, Error, OpKind, PathStats, PeerId, RecvBuf, SendBuf, ANY_PEER};
pub use transport::{IoCounters, Transport};
