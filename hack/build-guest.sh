#!/usr/bin/env bash
# Build the SoftRoCE test guest: Debian's own kernel (ELF vmlinux, booted directly by
# qemu), a debootstrap root (rdma-core, pyverbs, perftest, tcpdump, ...) with the kernel
# modules the project needs (each with its dependency closure) and the guest's init and
# command server (hack/guest/), and a tiny initramfs (busybox, virtio/9p/overlay modules)
# that mounts that root read-only over 9p under a tmpfs overlay. Also installs the
# project's Python dependencies for the guest's python3 into guest-python/ (shared with
# the guests over 9p and put on their PYTHONPATH).
#
# Output: ${XDG_CACHE_HOME:-~/.cache}/metaroce/guest/<key>/{vmlinux,initramfs.cpio,root/,
#   guest-python/,manifest.env,logs/} where <key> hashes hack/versions.env, this script,
#   the files of hack/guest/ and the resolved Debian kernel package version.
# Idempotent: a finished build is reused (guest-python is refreshed when the dependency
# list in pyproject.toml changes). Prints the cache directory on its last line of stdout.
# Progress goes to stderr. Needs root (debootstrap) and Debian's apt.
#
# Environment: METAROCE_PYTHON (the Python whose pip installs guest-python; default the
# repo's .venv, else python3).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
GUEST_PACKAGES="$GUEST_PACKAGES${GUEST_PACKAGES_EXTRA:+,$GUEST_PACKAGES_EXTRA}"

say() { printf '[build-guest] %s\n' "$*" >&2; }
die() { printf '[build-guest] ERROR: %s\n' "$*" >&2; exit 1; }

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/guest"
mkdir -p "$cache_root"
t0=$SECONDS

# step NAME LOG CMD... : run CMD with its output in LOG; on failure name the step and log.
step() {
  local name=$1 log=$2; shift 2
  local start=$SECONDS
  say "$name ... (log: $log)"
  if ! "$@" >"$log" 2>&1; then
    tail -n 25 "$log" >&2 || true
    die "step '$name' failed: read $log"
  fi
  say "$name: done in $((SECONDS - start)) s"
}

# --- host tools ---------------------------------------------------------------------
[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap needs it)"
command -v apt-get >/dev/null || die "needs a Debian host with apt-get"
missing=()
for tool in qemu-system-x86_64:qemu-system-x86 debootstrap:debootstrap cpio:cpio \
            depmod:kmod zstd:zstd xz:xz-utils dpkg-deb:dpkg python3:python3 flock:util-linux; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if ((${#missing[@]})); then
  hostlog="$cache_root/host-packages.log"
  say "installing host packages: ${missing[*]} (log: $hostlog)"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } \
    >"$hostlog" 2>&1 || die "step 'install host packages' failed: read $hostlog"
fi

py="${METAROCE_PYTHON:-}"
if [[ -z "$py" ]]; then
  if [[ -x "$repo/.venv/bin/python" ]]; then py="$repo/.venv/bin/python"; else py=python3; fi
fi

# --- resolve the kernel -------------------------------------------------------------
resolve_kernel() {  # the metapackage's candidate depends on exactly one image version
  local dep
  dep=$(apt-cache show --no-all-versions "$GUEST_KERNEL_PACKAGE" 2>/dev/null \
    | sed -n 's/^Depends: .*\(linux-image-[0-9][^ ,]*\) (= \([^)]*\)).*/\1 \2/p' | head -n1)
  kpkg=${dep% *}
  kpkg_version=${dep#* }
  [[ -n "$dep" && -n "$kpkg" && -n "$kpkg_version" ]]
}
# apt-cache is slow on a busy machine: reuse the last answer while apt's lists are
# unchanged.
lists_state=$( { echo "$GUEST_KERNEL_PACKAGE"; ls -l --time-style=+%s /var/lib/apt/lists/ 2>/dev/null; } \
  | sha256sum | cut -c1-16)
resolved="$cache_root/.kernel-$lists_state"
if [[ -s "$resolved" ]]; then
  read -r kpkg kpkg_version <"$resolved"
elif resolve_kernel; then
  rm -f "$cache_root"/.kernel-*
  echo "$kpkg $kpkg_version" >"$resolved"
else
  say "apt does not know $GUEST_KERNEL_PACKAGE yet: running apt-get update"
  apt-get update >"$cache_root/apt-update.log" 2>&1 \
    || die "step 'apt-get update' failed: read $cache_root/apt-update.log"
  resolve_kernel || die "cannot resolve $GUEST_KERNEL_PACKAGE through apt-cache (is this Debian $DEBIAN_SUITE?)"
  lists_state=$( { echo "$GUEST_KERNEL_PACKAGE"; ls -l --time-style=+%s /var/lib/apt/lists/ 2>/dev/null; } \
    | sha256sum | cut -c1-16)
  rm -f "$cache_root"/.kernel-*
  echo "$kpkg $kpkg_version" >"$cache_root/.kernel-$lists_state"
fi
kver=${kpkg#linux-image-}

key=$( {
  cat "$here/versions.env" "$here/build-guest.sh"
  for f in $(cd "$here/guest" && LC_ALL=C ls); do echo "== $f"; cat "$here/guest/$f"; done
  echo "kernel $kpkg=$kpkg_version"
} | sha256sum | cut -c1-12)
out="$cache_root/$key"

# --- guest-python (the project's dependencies, for the guest's python3) ---------------
guest_python() {
  local deps hash shared target
  deps=$("$py" - "$repo/pyproject.toml" <<'EOF'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["agent"]))
EOF
  ) || die "cannot read the dependency list from $repo/pyproject.toml"
  # Keyed by the dependency list, shared by every image build that has the same list.
  hash=$(printf '%s\n%s\n' "$GUEST_PYTHON_VERSION" "$deps" | sha256sum | cut -c1-12)
  shared="$cache_root/python/$hash"
  target="$out/guest-python"
  if [[ ! -f "$shared/.complete" ]]; then
    rm -rf "$shared"
    mkdir -p "$shared" "$out/logs"
    local pyver=${GUEST_PYTHON_VERSION/./}
    # Wheels for the guest's interpreter (Debian's python3) and glibc, whatever runs pip.
    # shellcheck disable=SC2086
    step "pip install guest-python ($(echo $deps | tr '\n' ' '))" "$out/logs/guest-python.log" \
      "$py" -m pip install --disable-pip-version-check --no-input --target "$shared/site" \
        --only-binary=:all: --implementation cp --python-version "$GUEST_PYTHON_VERSION" \
        --abi "cp$pyver" --abi abi3 --abi none \
        --platform manylinux_2_36_x86_64 --platform manylinux_2_34_x86_64 \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_12_x86_64 --platform manylinux2010_x86_64 \
        --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
        $deps
    touch "$shared/.complete"
  fi
  if [[ "$(readlink "$target" 2>/dev/null)" != "$shared/site" ]]; then
    rm -rf "$target"
    ln -s "$shared/site" "$target"
  fi
  say "guest-python: $target -> $shared/site"
}

# Only one build of a key at a time; a second caller waits and then reuses it.
exec 9>"$cache_root/.lock-$key"
flock 9

if [[ -f "$out/.complete" ]]; then
  say "cached image: $out (kernel $kpkg $kpkg_version)"
  guest_python
  echo "$out"
  exit 0
fi

say "building guest image $key: kernel $kpkg $kpkg_version, Debian $DEBIAN_SUITE"
rm -rf "$out"
mkdir -p "$out/logs"
logs="$out/logs"
work="$out/work"
mkdir -p "$work"

# --- kernel -------------------------------------------------------------------------
(cd "$work" && step "download $kpkg=$kpkg_version" "$logs/kernel-download.log" \
  apt-get download "$kpkg=$kpkg_version")
step "unpack $kpkg" "$logs/kernel-unpack.log" dpkg-deb -x "$work/${kpkg}_"*.deb "$work/kernel"
[[ -f "$work/kernel/boot/vmlinuz-$kver" ]] || die "the package $kpkg has no /boot/vmlinuz-$kver"

# Like the kernel's scripts/extract-vmlinux: find the compressed payload in the bzImage
# and decompress it into the ELF vmlinux, which qemu boots directly (PVH entry point).
extract_vmlinux() {
  "$py" - "$work/kernel/boot/vmlinuz-$kver" "$out/vmlinux" <<'EOF'
import gzip, lzma, subprocess, sys, zlib

data = open(sys.argv[1], "rb").read()

def xz(buf):
    return lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(buf)

def gz(buf):
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(buf)

def zst(buf):
    return subprocess.run(["zstd", "-dc"], input=buf, capture_output=True).stdout

for magic, fn in ((b"\xfd7zXZ\x00", xz), (b"\x28\xb5\x2f\xfd", zst), (b"\x1f\x8b\x08", gz)):
    start = 0
    while (pos := data.find(magic, start)) >= 0:
        start = pos + 1
        try:
            out = fn(data[pos:])
        except Exception:
            continue
        if out[:4] == b"\x7fELF":
            open(sys.argv[2], "wb").write(out)
            print(f"vmlinux: {len(out)} bytes from offset {pos} ({fn.__name__})")
            sys.exit(0)
sys.exit("no compressed ELF payload found in " + sys.argv[1])
EOF
}
step "extract vmlinux" "$logs/extract-vmlinux.log" extract_vmlinux

# --- root filesystem ------------------------------------------------------------------
# The debootstrap root is cached on its own (keyed by suite, mirror and package list), so
# a change to /init or to the module list rebuilds the image in seconds.
root="$out/root"
mkdir -p "$cache_root/debs" "$cache_root/rootfs"
rootfs_key=$(printf 'v1 %s %s %s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$GUEST_PACKAGES" \
  | sha256sum | cut -c1-12)
rootfs_tar="$cache_root/rootfs/$rootfs_key.tar.zst"
if [[ -f "$rootfs_tar" ]]; then
  step "unpack cached debootstrap root $rootfs_tar" "$logs/rootfs-unpack.log" \
    bash -c 'set -o pipefail; mkdir -p "$2" && zstd -dc "$1" | tar -C "$2" -xf -' _ "$rootfs_tar" "$root"
else
  step "debootstrap $DEBIAN_SUITE (minbase + $GUEST_PACKAGES)" "$logs/debootstrap.log" \
    debootstrap --variant=minbase --include="$GUEST_PACKAGES" --cache-dir="$cache_root/debs" \
      "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR"
  step "cache debootstrap root" "$logs/rootfs-cache.log" \
    bash -c 'set -o pipefail; tar -C "$2" -cf - . | zstd -q -T0 -3 -o "$1.tmp" && mv "$1.tmp" "$1"' \
      _ "$rootfs_tar" "$root"
fi

trim_root() {
  rm -rf "$root"/usr/share/{doc,man,info,locale,lintian,bug,bash-completion} \
         "$root"/var/cache/apt/* "$root"/var/lib/apt/lists/* "$root"/var/log/* \
         "$root"/var/cache/debconf/*-old "$root"/var/lib/dpkg/*-old \
         "$root"/usr/lib/udev/hwdb.bin "$root"/usr/lib/udev/hwdb.d \
         "$root"/usr/lib/x86_64-linux-gnu/gconv \
         "$root"/usr/lib/python3.11/{test,idlelib,tkinter,turtledemo,ensurepip,lib2to3,pydoc_data}
  mkdir -p "$root/usr/share/man" "$root/usr/share/doc"
}
step "trim root" "$logs/trim.log" trim_root

# --- kernel modules: a generous set plus each module's dependency closure --------------
# The kept modules go into the root (shared with the guests over 9p); the initramfs
# holds only what mounting that root takes: virtio, 9p and overlayfs.
BOOT_MODULES="virtio_pci virtio_net virtio_console virtio_rng 9pnet_virtio 9p overlay configfs"
initramfs="$work/initramfs"
install_modules() {
  local src="$work/kernel/lib/modules/$kver" dst="$root/usr/lib/modules/$kver"
  rm -rf "$dst"; mkdir -p "$dst"
  # The package leaves modules.dep to its postinst: generate it in the unpacked tree.
  depmod -b "$work/kernel" "$kver" || return 1
  "$py" - "$src" "$dst" <<'EOF' || return 1
import os, shutil, sys

src, dst = sys.argv[1], sys.argv[2]
# Directories (relative to kernel/) whose modules are all kept.
KEEP = ["net", "lib", "crypto", "arch", "mm", "block", "virt",
        "fs/9p", "fs/overlayfs", "fs/fuse", "fs/netfs", "fs/fscache", "fs/configfs",
        "fs/autofs", "fs/nls", "fs/squashfs", "fs/isofs",
        "drivers/infiniband/core", "drivers/infiniband/sw", "drivers/virtio",
        "drivers/char/virtio_console.ko", "drivers/char/hw_random",
        "drivers/block/virtio_blk.ko", "drivers/block/loop.ko", "drivers/block/nbd.ko",
        "drivers/scsi/virtio_scsi.ko", "drivers/net/vxlan", "drivers/net/ipvlan",
        "drivers/net/team", "drivers/net/bonding", "drivers/net/wireguard",
        "drivers/net/netdevsim", "drivers/net/phy", "drivers/md"]
# Under the kept directories, these are of no use to a test node.
DROP = ["net/bluetooth", "net/wireless", "net/mac80211", "net/nfc", "net/ieee802154",
        "net/mac802154", "net/can", "net/6lowpan", "net/ceph", "net/rxrpc", "net/sunrpc",
        "net/9p/9pnet_xen.ko", "net/9p/9pnet_rdma.ko", "drivers/md/bcache"]

def kept(rel):
    rel = rel[len("kernel/"):] if rel.startswith("kernel/") else rel
    if any(rel == d or rel.startswith(d + "/") for d in DROP):
        return False
    if rel.startswith("drivers/net/") and rel.count("/") == 2:
        return True  # top-level net drivers: veth, dummy, virtio_net, macvlan, tun, ...
    return any(rel == k or rel.startswith(k + "/") for k in KEEP)

deps = {}
with open(os.path.join(src, "modules.dep")) as f:
    for line in f:
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
chosen = {m for m in deps if kept(m)}
for m in list(chosen):  # modules.dep lists each module's full dependency list
    chosen.update(deps[m])
# Debian signs its modules; checking a signature costs real time under TCG. The guest
# does not enforce signatures, so the copies go without them (the kernel only notes a
# taint once).
MAGIC = b"~Module signature appended~\n"

def unsigned(data):
    if not data.endswith(MAGIC):
        return data
    sig_len = int.from_bytes(data[-len(MAGIC) - 4:-len(MAGIC)], "big")
    return data[:len(data) - len(MAGIC) - 12 - sig_len]

total = 0
for m in sorted(chosen):
    os.makedirs(os.path.dirname(os.path.join(dst, m)), exist_ok=True)
    with open(os.path.join(src, m), "rb") as f:
        data = unsigned(f.read())
    with open(os.path.join(dst, m), "wb") as f:
        f.write(data)
    total += len(data)
for fname in os.listdir(src):
    if fname.startswith("modules.") and fname.split(".")[1] in ("order", "builtin"):
        shutil.copy2(os.path.join(src, fname), os.path.join(dst, fname))
print(f"kept {len(chosen)} of {len(deps)} modules, {total // (1 << 20)} MiB")
EOF
  depmod -b "$root" "$kver" || return 1
  # Every module the project relies on must load from this tree with its closure.
  local m f
  for m in rdma_rxe ib_uverbs rdma_ucm ib_umad rdma_cm crc32_generic configfs \
           9p 9pnet_virtio virtio_pci virtio_net virtio_console virtio_rng veth dummy \
           act_pedit act_csum act_skbedit act_gact act_mirred cls_flower cls_u32 cls_bpf \
           sch_ingress sch_prio sch_mqprio sch_htb sch_netem sch_fq_codel \
           overlay bridge br_netfilter nf_tables nft_chain_nat nf_conntrack nf_nat \
           xt_MASQUERADE iptable_nat libcrc32c vxlan macvlan ipvlan tun; do
    modprobe -d "$root" -S "$kver" --show-depends "$m" >"$work/deps.txt" 2>&1 \
      || { cat "$work/deps.txt"; echo "module $m cannot be resolved"; return 1; }
    while read -r kind f _; do
      [[ "$kind" == insmod ]] || continue
      [[ -f "$f" ]] || { echo "module $m needs $f which is not in the image"; return 1; }
    done <"$work/deps.txt"
    echo "ok: $m ($(grep -c ^insmod "$work/deps.txt") files)"
  done
  # The initramfs: its boot modules in load order (busybox insmod, no modules.dep).
  rm -rf "$initramfs"; mkdir -p "$initramfs"
  : >"$initramfs/modules.order"
  for m in $BOOT_MODULES; do
    modprobe -d "$root" -S "$kver" --show-depends "$m" | awk '/^insmod/ {print $2}'
  done | awk '!seen[$0]++' | while read -r f; do
    local rel=${f#"$root"}
    mkdir -p "$initramfs$(dirname "$rel")"
    cp "$f" "$initramfs$rel"
    echo "$rel" >>"$initramfs/modules.order"
  done
  [[ -s "$initramfs/modules.order" ]] || { echo "no boot modules"; return 1; }
  echo "initramfs modules: $(wc -l <"$initramfs/modules.order")"
}
step "select kernel modules" "$logs/modules.log" install_modules

# --- the guest's own files --------------------------------------------------------------
# Stage 1 (the initramfs's /init, busybox) mounts the root over 9p under an overlay and
# switches to stage 2 (hack/guest/init in the root), which starts guestd.
[[ -x "$root/bin/busybox" ]] || die "the root has no busybox (GUEST_PACKAGES needs busybox-static)"
install -D -m 0755 "$here/guest/init" "$root/usr/lib/metaroce/init"
install -D -m 0755 "$here/guest/guestd.py" "$root/usr/lib/metaroce/guestd.py"
for f in "$here"/guest/*; do
  case "${f##*/}" in
    init|guestd.py|initramfs-init) ;;
    *) install -D -m 0644 "$f" "$root/usr/lib/metaroce/${f##*/}" ;;
  esac
done
echo "$kver" >"$root/etc/metaroce-kernel"

pack() {
  mkdir -p "$initramfs"/{bin,dev,proc,sys,lower,upper,newroot} || return 1
  cp "$root/bin/busybox" "$initramfs/bin/busybox" || return 1
  ln -sf busybox "$initramfs/bin/sh"
  install -m 0755 "$here/guest/initramfs-init" "$initramfs/init" || return 1
  (cd "$initramfs" && find . -print0 | LC_ALL=C sort -z \
    | cpio --null -o -H newc --reproducible --quiet) >"$out/initramfs.cpio"
}
step "pack initramfs" "$logs/pack.log" pack

{
  echo "KERNEL_PACKAGE=$kpkg"
  echo "KERNEL_PACKAGE_VERSION=$kpkg_version"
  echo "KERNEL_RELEASE=$kver"
  echo "VMLINUX_BYTES=$(stat -c %s "$out/vmlinux")"
  echo "INITRAMFS_BYTES=$(stat -c %s "$out/initramfs.cpio")"
  echo "ROOT_BYTES=$(du -sb "$root" | cut -f1)"
  echo "BUILD_SECONDS=$((SECONDS - t0))"
} >"$out/manifest.env"
rm -rf "$work"
guest_python
touch "$out/.complete"

# Keep the three newest finished images (and the newest three rootfs and guest-python
# builds); drop unfinished builds nobody is working on.
prune() {
  local dir=$1 pattern=$2 keep=$3 d
  # shellcheck disable=SC2012
  ls -1td "$dir"/$pattern 2>/dev/null | tail -n +$((keep + 1)) | while read -r d; do
    [[ "$d" == "$out" ]] || rm -rf "$d"
  done
}
for d in "$cache_root"/*/; do
  d=${d%/}; k=${d##*/}
  [[ "$k" =~ ^[0-9a-f]{12}$ && ! -f "$d/.complete" && "$d" != "$out" ]] || continue
  if flock -n "$cache_root/.lock-$k" true 2>/dev/null; then rm -rf "$d" "$cache_root/.lock-$k"; fi
done
mapfile -t finished < <(ls -1td "$cache_root"/*/.complete 2>/dev/null | tail -n +4)
for f in "${finished[@]}"; do
  d=${f%/.complete}
  [[ "$d" != "$out" ]] && rm -rf "$d"
done
prune "$cache_root/rootfs" '*.tar.zst' 3
prune "$cache_root/python" '*' 3
say "done in $((SECONDS - t0)) s: $out (vmlinux $(du -h "$out/vmlinux" | cut -f1), initramfs $(du -h "$out/initramfs.cpio" | cut -f1), root $(du -sh "$root" | cut -f1))"
echo "$out"
