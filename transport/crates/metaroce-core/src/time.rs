//! Time is injected: the core never reads a clock. Microseconds since an
//! arbitrary origin chosen by the driver.
pub type Micros = u64;

pub const MS: Micros = 1_000;
pub const SEC: Micros = 1_000_000;
