#!/usr/bin/env bash
# Build NCCL's net plugin into RELEASE_DIR (the cargo release directory that holds
# libmetaroce.a; default: ../target/release). Result:
#   RELEASE_DIR/libnccl-net-metaroce.so   the plugin (NCCL_NET_PLUGIN=metaroce with
#                                         RELEASE_DIR on LD_LIBRARY_PATH)
#   RELEASE_DIR/nccl/                     objects and the conformance harness nccl-net-check
# hack/build-transport.sh calls this after cargo build.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
release=$(cd "${1:-$here/../target/release}" && pwd)
[[ -f "$release/libmetaroce.a" ]] || { echo "build.sh: $release/libmetaroce.a missing: cargo build --release first" >&2; exit 1; }
make -s -C "$here" MR_LIB="$release/libmetaroce.a" OUT="$release/nccl" all check harness >&2
# Replace atomically: a running job may have the old one mapped.
cp "$release/nccl/libnccl-net-metaroce.so" "$release/.libnccl-net-metaroce.so.tmp"
mv -f "$release/.libnccl-net-metaroce.so.tmp" "$release/libnccl-net-metaroce.so"
echo "$release/libnccl-net-metaroce.so"
