#!/usr/bin/env bash
# Build the MetaRoCE transport (transport/: the Rust workspace, the libfabric
# provider and NCCL's net plugin where transport/libfabric/ and transport/nccl/ have
# their build scripts) in release mode, against a declared glibc floor.
#
# Output: ${XDG_CACHE_HOME:-~/.cache}/metaroce/transport/target/release/ (or
# $CARGO_TARGET_DIR/release when that is set, e.g. a worktree's own) with
# libmetaroce.{so,a}, metaroce-perf, libmetaroce-fi.so and libnccl-net-metaroce.so.
# Cargo's own incremental state lives there too, so a warm build is seconds. Prints
# that release directory on its last line of stdout; progress on stderr. The
# toolchain is pinned by transport/rust-toolchain.toml; crates by transport/Cargo.lock
# (--locked).
#
# glibc floor (issue 14 item 5): the agent mounts these files into training images
# with their own, older glibc (RHEL 8: 2.28, Debian 11: 2.31), so every file is linked
# against glibc GLIBC_FLOOR's symbol versions, not this host's: the Rust workspace with
# `cargo zigbuild --target x86_64-unknown-linux-gnu.$GLIBC_FLOOR` (zig's linker and its
# glibc stubs; the host's rustup target, no extra one), the C parts with `zig cc -target
# x86_64-linux-gnu.$GLIBC_FLOOR` against Debian's libfabric-dev headers. zig (PyPI's
# ziglang) and cargo-zigbuild (crates.io) are pinned below and installed when missing
# under ${XDG_CACHE_HOME:-~/.cache}/metaroce/tools/, keyed by their versions (cold: about
# a minute, mostly compiling cargo-zigbuild). tests/transport/test_abi.py checks the result.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
say() { printf '[build-transport] %s\n' "$*" >&2; }
die() { printf '[build-transport] ERROR: %s\n' "$*" >&2; exit 1; }

GLIBC_FLOOR=2.28
ZIG_VERSION=0.15.2
CARGO_ZIGBUILD_VERSION=0.24.1
arch=$(uname -m)
[[ $arch == x86_64 || $arch == aarch64 ]] || die "unsupported machine $arch (x86_64 or aarch64)"
triple="$arch-unknown-linux-gnu"

command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (the toolchain in transport/rust-toolchain.toml)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$cache/transport/target}"
mkdir -p "$CARGO_TARGET_DIR" "$cache/tools"
# One build at a time per target directory: worktrees share the cache's, and the C parts
# (the compiler wrapper replaced whole, make's outputs) broke when two builds overlapped
# (seen: "cannot stat .../libfabric/libmetaroce-fi.so" in an image build beside a setup).
exec 8>"$CARGO_TARGET_DIR/.build.lock"
if ! flock -n 8; then
  say "waiting for another build in $CARGO_TARGET_DIR"
  flock 8
fi

# --- the pinned zig and cargo-zigbuild (installed once, into a temporary name, then
# renamed, under a lock: worktrees build concurrently) ----------------------------------
tools="$cache/tools"
zig_dir="$tools/ziglang-$ZIG_VERSION"
czb_dir="$tools/cargo-zigbuild-$CARGO_ZIGBUILD_VERSION"
if [[ ! -x "$zig_dir/zig" || ! -x "$czb_dir/bin/cargo-zigbuild" ]]; then
  exec 9>"$tools/.lock"
  flock 9
  if [[ ! -x "$zig_dir/zig" ]]; then
    t0=$SECONDS
    say "installing zig $ZIG_VERSION (PyPI ziglang) into $zig_dir"
    py=${PYTHON:-python3}
    rm -rf "$zig_dir.tmp"
    "$py" -m venv "$zig_dir.tmp/venv" || die "$py -m venv failed (Debian: apt-get install python3-venv)"
    "$zig_dir.tmp/venv/bin/pip" install -q --disable-pip-version-check "ziglang==$ZIG_VERSION" \
      || die "pip install ziglang==$ZIG_VERSION failed: is PyPI reachable?"
    zig_bins=("$zig_dir.tmp"/venv/lib/python3*/site-packages/ziglang/zig)
    zig_bin=${zig_bins[0]}
    [[ -x "$zig_bin" ]] || die "ziglang==$ZIG_VERSION installed no zig binary"
    # The venv's paths are absolute: link the binary at its final place, then rename.
    ln -s "${zig_bin/#$zig_dir.tmp/$zig_dir}" "$zig_dir.tmp/zig"
    rm -rf "$zig_dir"
    mv "$zig_dir.tmp" "$zig_dir"
    "$zig_dir/zig" version >/dev/null || die "$zig_dir/zig does not run"
    say "zig $ZIG_VERSION installed ($((SECONDS - t0)) s)"
  fi
  if [[ ! -x "$czb_dir/bin/cargo-zigbuild" ]]; then
    t0=$SECONDS
    say "installing cargo-zigbuild $CARGO_ZIGBUILD_VERSION (crates.io) into $czb_dir"
    rm -rf "$czb_dir.tmp"
    # Its own target dir: not the transport's, and gone after the install. --debug: it
    # only drives cargo and zig, and compiles in a third of the time (CI's cold run).
    CARGO_TARGET_DIR="$czb_dir.tmp/target" nice -n 10 cargo install -q --locked --debug \
      cargo-zigbuild --version "$CARGO_ZIGBUILD_VERSION" --root "$czb_dir.tmp" >&2 \
      || die "cargo install cargo-zigbuild $CARGO_ZIGBUILD_VERSION failed: is crates.io reachable?"
    rm -rf "$czb_dir.tmp/target"
    rm -rf "$czb_dir"
    mv "$czb_dir.tmp" "$czb_dir"
    say "cargo-zigbuild $CARGO_ZIGBUILD_VERSION installed ($((SECONDS - t0)) s)"
  fi
  exec 9>&-
fi
export CARGO_ZIGBUILD_ZIG_PATH="$zig_dir/zig"
export PATH="$czb_dir/bin:$PATH"

# --- the Rust workspace ------------------------------------------------------------------
t0=$SECONDS
(cd "$repo/transport" && cargo zigbuild --release --locked --workspace --target "$triple.$GLIBC_FLOOR" >&2) \
  || die "cargo zigbuild failed (see above)"
say "Rust workspace built against glibc $GLIBC_FLOOR ($((SECONDS - t0)) s)"
# With --target cargo writes to $CARGO_TARGET_DIR/$triple/release; everything else (the
# images, tests/transport, the e2e pods) reads $CARGO_TARGET_DIR/release, so the final
# artifacts go there, replaced by rename (a running job may have the old one mapped) and
# only when changed (a host `cargo test --release` may have put its own there meanwhile).
built="$CARGO_TARGET_DIR/$triple/release"
release="$CARGO_TARGET_DIR/release"
mkdir -p "$release"
for f in "$built"/libmetaroce.so "$built"/libmetaroce.a "$built"/metaroce-perf; do
  [[ -f "$f" ]] || die "cargo zigbuild succeeded but $f is missing"
  dest="$release/$(basename "$f")"
  cmp -s "$f" "$dest" || { cp "$f" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"; }
done

# --- the C parts: zig cc at the same floor, Debian's libfabric-dev headers -----------------
# zig cc with a -target sees no system paths, so a directory holding only libfabric's
# headers (rdma/) and libfabric.so stands in for them (the whole /usr/include would put
# this host's glibc headers before zig's). The wrapper drops --exclude-libs, which zig's
# linker refuses: the version scripts (exports.map, `local: *`) already keep every
# symbol of libmetaroce.a local, and each Makefile's `check` verifies the exports.
# make_cc DIR RDMA_INCLUDE FABRIC_SO: the wrapper DIR/cc, for one libfabric's headers.
make_cc() {
  local zcc=$1 rdma=$2 so=$3
  rm -rf "$zcc.tmp.$$"
  mkdir -p "$zcc.tmp.$$/include" "$zcc.tmp.$$/lib"
  ln -s "$rdma" "$zcc.tmp.$$/include/rdma"
  ln -s "$so" "$zcc.tmp.$$/lib/libfabric.so"
  cat >"$zcc.tmp.$$/cc" <<WRAPPER
#!/usr/bin/env bash
# zig cc for glibc $GLIBC_FLOOR and $rdma (written by hack/build-transport.sh)
args=()
for a in "\$@"; do [[ \$a == -Wl,--exclude-libs,ALL ]] || args+=("\$a"); done
exec "$zig_dir/zig" cc -target $arch-linux-gnu.$GLIBC_FLOOR -I"$zcc/include" -L"$zcc/lib" "\${args[@]}"
WRAPPER
  chmod +x "$zcc.tmp.$$/cc"
  rm -rf "$zcc"
  mv "$zcc.tmp.$$" "$zcc"
}
zcc="$CARGO_TARGET_DIR/zig-cc-$ZIG_VERSION-$GLIBC_FLOOR"
[[ -f /usr/include/rdma/fabric.h ]] || die "/usr/include/rdma/fabric.h missing: apt-get install libfabric-dev"
fabric_so=$(ls /usr/lib/"$arch"-linux-gnu/libfabric.so.1 2>/dev/null) || die "libfabric.so.1 missing: apt-get install libfabric-dev"
make_cc "$zcc" /usr/include/rdma "$fabric_so"
export CC="$zcc/cc" GLIBC_FLOOR
# make does not track the compiler: objects another compiler (a build before this floor,
# another zig) left in the C parts' output directories are removed, so none is reused.
for out in "$release/libfabric" "$release/nccl"; do
  if [[ -d "$out" && "$(cat "$out/.compiler" 2>/dev/null)" != "$zcc" ]]; then rm -rf "$out"; fi
  mkdir -p "$out"
  echo "$zcc" >"$out/.compiler"
done
if [[ -x "$repo/transport/libfabric/build.sh" ]]; then
  t0=$SECONDS
  bash "$repo/transport/libfabric/build.sh" "$release" >&2 || die "libfabric provider build failed (see above)"
  say "libfabric provider built ($((SECONDS - t0)) s)"
  # The same provider for libfabric 2.x cores (their fi_info layout; see prov.c), against
  # Debian trixie's libfabric-dev: each build registers only in the cores it is right for.
  t0=$SECONDS
  fi2=$(bash "$repo/hack/fetch-libfabric2.sh") || die "libfabric 2.x headers not fetched (see above)"
  fi2_libs=("$fi2"/usr/lib/*/libfabric.so.1)
  fi2_so=${fi2_libs[0]}
  make_cc "$zcc-fi2" "$fi2/usr/include/rdma" "$fi2_so"
  out="$release/libfabric-v2"  # its objects go when the compiler or the headers change
  if [[ -d "$out" && "$(cat "$out/.compiler" 2>/dev/null)" != "$zcc-fi2 $fi2" ]]; then rm -rf "$out"; fi
  mkdir -p "$out"
  echo "$zcc-fi2 $fi2" >"$out/.compiler"
  CC="$zcc-fi2/cc" FABRIC_SO="$fi2_so" OUT_SUFFIX=-v2 bash "$repo/transport/libfabric/build.sh" \
    "$release" libmetaroce-v2-fi.so >&2 || die "libfabric 2.x provider build failed (see above)"
  say "libfabric 2.x provider built ($((SECONDS - t0)) s)"
fi
if [[ -x "$repo/transport/nccl/build.sh" ]]; then
  t0=$SECONDS
  bash "$repo/transport/nccl/build.sh" "$release" >&2 || die "NCCL net plugin build failed (see above)"
  say "NCCL net plugin built ($((SECONDS - t0)) s)"
fi
echo "$release"
