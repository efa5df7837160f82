#!/usr/bin/env bash
# Stage the MetaRoCE transport for the agent image: build it (hack/build-transport.sh)
# and lay out DEST (default images/agent/transport, which images/agent/Dockerfile copies
# to /opt/metaroce/transport) as the agent's driver expects it:
#   DEST/VERSION, DEST/lib/{libmetaroce-fi.so,libmetaroce-v2-fi.so,libnccl-net-metaroce.so}
#   (the provider's builds for libfabric 1.x and 2.x: each registers only where it is right),
#   DEST/bin/{metaroce-perf,nccl-net-check,metaroce-fi-selftest}
# (node-agent/metaroce_agent/transport/library.py). DEST is replaced whole; prints it.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
dest=${1:-$repo/images/agent/transport}
release=$(bash "$here/build-transport.sh" | tail -n 1)
version=$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/transport/Cargo.toml" | head -n 1)
[[ -n "$version" ]] || { echo "stage-transport: no version in transport/Cargo.toml" >&2; exit 1; }
tmp="$dest.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp/lib" "$tmp/bin"
install -m 0644 "$release/libmetaroce-fi.so" "$release/libmetaroce-v2-fi.so" \
  "$release/libnccl-net-metaroce.so" "$tmp/lib/"
install -m 0755 "$release/metaroce-perf" "$release/nccl/nccl-net-check" "$tmp/bin/"
install -m 0755 "$release/libfabric/selftest" "$tmp/bin/metaroce-fi-selftest"
echo "$version" >"$tmp/VERSION"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "$dest"
