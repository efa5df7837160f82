#!/usr/bin/env bash
# Build the libfabric provider into RELEASE_DIR (the cargo release directory that
# holds libmetaroce.a; default: ../target/release) as NAME (default libmetaroce-fi.so).
# Result:
#   RELEASE_DIR/NAME               the provider (FI_PROVIDER_PATH=RELEASE_DIR)
#   RELEASE_DIR/libfabric[-SUFFIX] objects and the self-test (selftest)
# The compiler's headers and FABRIC_SO (the libfabric.so.1 it links; default the
# host's) say which libfabric the build is for. hack/build-transport.sh calls this
# after cargo build, once for Debian 12's libfabric 1.17 and once for 2.x
# (NAME libmetaroce-v2-fi.so, OUT_SUFFIX -v2).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
release=$(cd "${1:-$here/../target/release}" && pwd)
name=${2:-libmetaroce-fi.so}
out="$release/libfabric${OUT_SUFFIX:-}"
[[ -f "$release/libmetaroce.a" ]] || { echo "build.sh: $release/libmetaroce.a missing: cargo build --release first" >&2; exit 1; }
make -s -C "$here" MR_LIB="$release/libmetaroce.a" OUT="$out" ${FABRIC_SO:+FABRIC_SO="$FABRIC_SO"} check selftest >&2
# Replace atomically: a running job may have the old one mapped.
cp "$out/libmetaroce-fi.so" "$release/.$name.tmp"
mv -f "$release/.$name.tmp" "$release/$name"
echo "$release/$name"
