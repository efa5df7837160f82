#!/usr/bin/env bash
# Build the libfabric provider into RELEASE_DIR (the cargo release directory that
# holds libmetaroce.a; default: ../target/release). Result:
#   RELEASE_DIR/libmetaroce-fi.so   the provider (FI_PROVIDER_PATH=RELEASE_DIR)
#   RELEASE_DIR/libfabric/          objects and the self-test (selftest)
# hack/build-transport.sh calls this after cargo build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
release=$(cd "${1:-$here/../target/release}" && pwd)
[[ -f "$release/libmetaroce.a" ]] || { echo "build.sh: $release/libmetaroce.a missing: cargo build --release first" >&2; exit 1; }
make -s -C "$here" MR_LIB="$release/libmetaroce.a" OUT="$release/libfabric" check selftest >&2
# Replace atomically: a running job may have the old one mapped.
cp "$release/libfabric/libmetaroce-fi.so" "$release/.libmetaroce-fi.so.tmp"
mv -f "$release/.libmetaroce-fi.so.tmp" "$release/libmetaroce-fi.so"
echo "$release/libmetaroce-fi.so"
