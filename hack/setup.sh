#!/usr/bin/env bash
# Set up a fresh Debian 12 machine for the demo and the tests: host packages, the
# Python environment (.venv), the pinned Kubernetes binaries, Multus and the SoftRoCE
# guest image. Idempotent and quick when everything is already there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '[setup] %s\n' "$*" >&2; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) -eq 0 ]] || die "run as root: the harness creates network namespaces and installs packages"

# --- host packages ------------------------------------------------------------------
packages=(iproute2 kmod procps util-linux qemu-system-x86 debootstrap cpio zstd xz-utils dpkg-dev shellcheck)
# The MetaRoCE transport's tests and benchmarks: real libfabric clients, Open MPI,
# mpi4py, nftables for the namespace fabric, iperf3 for its capacity.
packages+=(libfabric-dev libfabric-bin openmpi-bin libopenmpi-dev python3-mpi4py nftables iperf3)
missing=()
for p in "${packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if ((${#missing[@]})); then
  say "installing host packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || die "apt-get update failed: is the Debian mirror reachable?"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || die "apt-get install ${missing[*]} failed"
fi

command -v go >/dev/null || die "Go >= 1.26 is required to build the pinned Kubernetes binaries (see README)"
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || die "$py is older than 3.11; set PYTHON to a Python 3.11+ interpreter"

# --- Python environment ---------------------------------------------------------------
stamp=.venv/.metaroce-installed
want=$(sha256sum pyproject.toml | cut -c1-16)
if [[ ! -x .venv/bin/python || "$(cat "$stamp" 2>/dev/null)" != "$want" ]]; then
  say "creating .venv and installing the project (editable) with its agent and dev extras"
  "$py" -m venv .venv
  .venv/bin/pip install -q --upgrade pip >/dev/null
  .venv/bin/pip install -q -e '.[agent,dev]' || die "pip install failed: see the output above"
  echo "$want" >"$stamp"
fi

# --- heavy artefacts, cached outside the repo -------------------------------------------
t0=$SECONDS
bash hack/build-transport.sh >/dev/null
say "MetaRoCE transport built ($((SECONDS - t0)) s)"
t0=$SECONDS
bash hack/build-k8s.sh >/dev/null
say "Kubernetes binaries ready ($((SECONDS - t0)) s)"
# Multus (the real-node guests' CNI meta-plugin): one Go binary, ~100 s of compiling on a
# cold Go build cache, started beside the guest image build (debootstrap, mostly waiting
# on the mirror and the disk) rather than after it; a few ms once cached.
t_multus=$SECONDS
multus_log=$(mktemp)
bash hack/build-multus.sh >/dev/null 2>"$multus_log" &
multus_pid=$!
if [[ -f hack/build-guest.sh && "${METAROCE_SKIP_GUEST_IMAGE:-0}" != 1 ]]; then
  t0=$SECONDS
  bash hack/build-guest.sh >/dev/null
  say "SoftRoCE guest image ready ($((SECONDS - t0)) s)"
fi
if ! wait "$multus_pid"; then
  cat "$multus_log" >&2
  die "building Multus failed (hack/build-multus.sh): see above"
fi
rm -f "$multus_log"
say "Multus ready ($((SECONDS - t_multus)) s, beside the guest image)"
[[ "${METAROCE_SKIP_IMAGES:-0}" == 1 ]] || { t0=$SECONDS; bash hack/build-images.sh >/dev/null; say "container images ready ($((SECONDS - t0)) s)"; }
