#!/usr/bin/env bash
# libfabric 2.x's headers and libfabric.so.1 (Debian trixie's libfabric-dev and
# libfabric1), for the provider's second build (hack/build-transport.sh): libfabric 2.0
# moved the fi_info layout that fi_dupinfo writes to FABRIC_1.8, so a provider built
# against Debian 12's 1.17 headers is wrong in a 2.x core (transport/libfabric/prov.c).
#
#   bash hack/fetch-libfabric2.sh     # prints the directory (usr/include/rdma, usr/lib/*/)
#
# `apt-get download` with a private apt state (nothing of the host's apt is touched), so
# the packages are the suite's current ones, checked against its signed index by the
# host's debian-archive-keyring. Unpacked once into
# ${XDG_CACHE_HOME:-~/.cache}/metaroce/tools/libfabric-dev-VERSION/, keyed by the
# version apt resolved; reused while that version is current. Root not needed.
set -euo pipefail
say() { printf '[fetch-libfabric2] %s\n' "$*" >&2; }
die() { printf '[fetch-libfabric2] ERROR: %s\n' "$*" >&2; exit 1; }

SUITE=${METAROCE_LIBFABRIC2_SUITE:-trixie}
MIRROR=${METAROCE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
arch=$(dpkg --print-architecture)
tools="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/tools"
mkdir -p "$tools"
exec 7>"$tools/.lock-libfabric2"
flock 7

state="$tools/.apt-$SUITE"
mkdir -p "$state/lists/partial" "$state/cache/archives/partial"
echo "deb [arch=$arch] $MIRROR $SUITE main" >"$state/sources.list"
apt=(-o "Dir::Etc::SourceList=$state/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
     -o "Dir::State::Lists=$state/lists" -o "Dir::State::Status=/dev/null"
     -o "Dir::Cache=$state/cache" -o "APT::Architecture=$arch" -o "Debug::NoLocking=1"
     -o "APT::Sandbox::User=root")
# The index is refreshed at most once a day (a cold CI run fetches it once).
if [[ -z $(find "$state/lists" -name '*_Packages*' -mtime -1 2>/dev/null | head -n 1) ]]; then
  apt-get -q "${apt[@]}" update >&2 || die "apt-get update for $SUITE from $MIRROR failed: is the mirror reachable?"
fi
version=$(apt-cache "${apt[@]}" show libfabric-dev 2>/dev/null | sed -n 's/^Version: //p' | head -n 1)
[[ -n $version ]] || die "$SUITE has no libfabric-dev in $MIRROR"
[[ $version == 2.* ]] || die "$SUITE's libfabric-dev is $version, not 2.x: set METAROCE_LIBFABRIC2_SUITE"
dir="$tools/libfabric-dev-$version"
if [[ ! -f "$dir/usr/include/rdma/fabric.h" ]]; then
  t0=$SECONDS
  tmp="$dir.tmp.$$"
  rm -rf "$tmp"
  mkdir -p "$tmp"
  (cd "$tmp" && apt-get -q "${apt[@]}" download "libfabric-dev=$version" "libfabric1=$version" >&2) \
    || die "apt-get download libfabric-dev=$version libfabric1=$version failed"
  for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$tmp/root"; done
  rm -f "$tmp"/*.deb
  mv "$tmp/root" "$tmp.root" && rm -rf "$tmp" && rm -rf "$dir" && mv "$tmp.root" "$dir"
  say "libfabric-dev $version ($SUITE) unpacked into $dir ($((SECONDS - t0)) s)"
fi
major=$(sed -n 's/^#define FI_MAJOR_VERSION //p' "$dir/usr/include/rdma/fabric.h")
[[ $major == 2 ]] || die "$dir: FI_MAJOR_VERSION $major, not 2"
ls "$dir"/usr/lib/*/libfabric.so.1 >/dev/null 2>&1 || die "$dir has no libfabric.so.1"
echo "$dir"
