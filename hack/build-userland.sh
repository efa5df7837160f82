#!/usr/bin/env bash
# A Debian root of another release (default bullseye: Debian 11, glibc 2.31, libfabric
# 1.11), standing in for a training image's userland in tests/transport/test_old_userland.py:
# the transport's files must load in an image older (or newer) than the build host.
#
#   bash hack/build-userland.sh [SUITE]   # prints the tarball's path on its last line
#
# debootstrap --variant=minbase SUITE with libfabric1 and libfabric-bin (fi_info,
# fi_pingpong) from the Debian mirror, packed as
# ${XDG_CACHE_HOME:-~/.cache}/metaroce/userland/debian-SUITE-KEY.tar.zst, KEY hashing the
# suite, the package list and this script; the suite's Release date is recorded beside it
# (.info). Built once (cold: a few minutes, mostly downloads), then reused. Root.
set -euo pipefail
say() { printf '[build-userland] %s\n' "$*" >&2; }
die() { printf '[build-userland] ERROR: %s\n' "$*" >&2; exit 1; }

suite=${1:-bullseye}
[[ $suite =~ ^[a-z]+$ ]] || die "SUITE '$suite' is not a Debian codename (bullseye, bookworm, trixie)"
[[ -f /usr/share/debootstrap/scripts/$suite ]] || die "debootstrap does not know '$suite' (apt-get install debootstrap, or a newer one)"
[[ $(id -u) -eq 0 ]] || die "run as root (debootstrap)"
command -v debootstrap >/dev/null || die "debootstrap not found: apt-get install debootstrap"
command -v zstd >/dev/null || die "zstd not found: apt-get install zstd"
mirror=${METAROCE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=libfabric1,libfabric-bin
key=$( { echo "$suite $packages $mirror"; cat "${BASH_SOURCE[0]}"; } | sha256sum | cut -c1-12)
dir="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/userland"
tarball="$dir/debian-$suite-$key.tar.zst"
mkdir -p "$dir"
exec 9>"$dir/.lock-$suite"
flock 9
if [[ ! -f "$tarball" ]]; then
  t0=$SECONDS
  root="$dir/.root-$suite.$$"
  trap 'rm -rf "$root" "$tarball.tmp"' EXIT
  say "debootstrap $suite ($packages) from $mirror into $root"
  nice -n 10 debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" \
    >"$dir/debootstrap-$suite.log" 2>&1 \
    || die "debootstrap $suite failed: see $dir/debootstrap-$suite.log ($(tail -n 1 "$dir/debootstrap-$suite.log"))"
  release_date=$(sed -n 's/^Date: //p' "$root"/var/lib/apt/lists/*_Release 2>/dev/null | head -n 1)
  # shellcheck disable=SC2016  # dpkg-query's own ${Version}
  versions=$(chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' libc6 libfabric1)
  # Only what a test needs: no apt lists or package cache.
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  {
    echo "suite: $suite"
    echo "packages: $packages"
    echo "mirror: $mirror"
    echo "built: $(date -u +%FT%TZ)"
    echo "release-date: ${release_date:-unknown}"
    echo "$versions"
  } >"${tarball%.tar.zst}.info"
  tar -C "$root" --numeric-owner -cf - . | nice -n 10 zstd -q -T0 -o "$tarball.tmp"
  mv "$tarball.tmp" "$tarball"
  say "$suite root packed into $tarball ($((SECONDS - t0)) s)"
fi
echo "$tarball"
