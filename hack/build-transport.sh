#!/usr/bin/env bash
# Build the MetaRoCE transport (transport/: the Rust workspace, the libfabric
# provider and NCCL's net plugin where transport/libfabric/ and transport/nccl/ have
# their build scripts) in release mode.
#
# Output: ${XDG_CACHE_HOME:-~/.cache}/metaroce/transport/target/release/ (or
# $CARGO_TARGET_DIR/release when that is set, e.g. a worktree's own) with
# libmetaroce.{so,a}, metaroce-perf, libmetaroce-fi.so and libnccl-net-metaroce.so.
# Cargo's own incremental state lives there too, so a warm build is seconds. Prints
# that release directory on its last line of stdout; progress on stderr. The
# toolchain is pinned by transport/rust-toolchain.toml; crates by transport/Cargo.lock
# (--locked).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
say() { printf '[build-transport] %s\n' "$*" >&2; }
die() { printf '[build-transport] ERROR: %s\n' "$*" >&2; exit 1; }

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (the toolchain in transport/rust-toolchain.toml)"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/transport/target}"
mkdir -p "$CARGO_TARGET_DIR"
t0=$SECONDS
(cd "$repo/transport" && cargo build --release --locked --workspace >&2) || die "cargo build failed (see above)"
say "Rust workspace built ($((SECONDS - t0)) s)"
release="$CARGO_TARGET_DIR/release"
if [[ -x "$repo/transport/libfabric/build.sh" ]]; then
  t0=$SECONDS
  bash "$repo/transport/libfabric/build.sh" "$release" >&2 || die "libfabric provider build failed (see above)"
  say "libfabric provider built ($((SECONDS - t0)) s)"
fi
if [[ -x "$repo/transport/nccl/build.sh" ]]; then
  t0=$SECONDS
  bash "$repo/transport/nccl/build.sh" "$release" >&2 || die "NCCL net plugin build failed (see above)"
  say "NCCL net plugin built ($((SECONDS - t0)) s)"
fi
echo "$release"
