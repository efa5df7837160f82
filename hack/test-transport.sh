#!/usr/bin/env bash
# The transport tier: rustfmt and clippy, then the workspace's tests (the protocol
# core under the seeded impairment model, property tests, the fuzz corpus, real
# sockets on loopback) in release mode against the target directory setup built,
# then tests/transport: the namespace fabrics, and real clients (fi_pingpong,
# Open MPI with mpi4py) over the libfabric provider and the other arms. Root.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../transport"
export CARGO_TARGET_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/transport/target"
say() { printf '\n[test-transport] %s\n' "$*" >&2; }
say "cargo fmt --check, clippy -D warnings"
cargo fmt --all --check
cargo clippy --release --locked --workspace --all-targets -- -D warnings
say "cargo test (release)"
cargo test --release --locked --workspace
say "pytest tests/transport (fabrics, provider, real clients)"
cd ..
.venv/bin/pytest tests/transport -q -m transport --durations=15
