#!/usr/bin/env bash
# Build the project's container images without a registry: nothing is pulled.
#
#  - base:      a Debian root made here by debootstrap (minbase, DEBIAN_SUITE from
#               hack/versions.env), committed as localhost/metaroce-base:<suite>-<key>;
#  - agent, operator: images/{agent,operator}/Dockerfile -- the same files users build
#               with Docker -- built by buildah (daemonless, --isolation chroot) with
#               BASE set to that base image;
#  - rdma-test: images/rdma-test/Dockerfile (the e2e tier's RDMA workload: perftest on
#               top of the agent image);
#  - pause:     the pod sandbox image, images/pause/pause.go built static with the
#               machine's Go into an image of that one file.
#
# Output: ${XDG_CACHE_HOME:-~/.cache}/metaroce/images/<key>/{agent,operator,rdma-test,
#   pause}.tar (OCI archives: `ctr image import`, `kind load image-archive`, `docker
#   load` and `podman load` read them; layers stored uncompressed), node-containerd.tar
#   (containerd's state with pause, agent and rdma-test unpacked, and the agent's next
#   version for the upgrade test, for the qemu test nodes:
#   hack/metaroce_harness/nodes.py), manifest.env (each image's reference and
#   archive) and logs/, where <key> hashes this script, images/, every file the
#   Dockerfiles copy and the pins DEBIAN_SUITE, DEBIAN_MIRROR and IMAGE_* of
#   hack/versions.env. buildah's storage (with its layer cache: a source change does not
#   redo the apt-get layers) is .../images/storage.
# Idempotent: a finished build is reused. Prints the output directory on its last line
# of stdout; progress goes to stderr. Needs root, Go, and Debian's apt (installs buildah
# and containerd).
#
# The RUN steps reach the Debian mirror and PyPI. On a host whose pip trusts a private
# CA (PIP_CERT, or a pip.conf `cert`), the build mounts that bundle and a pip.conf
# naming it into the RUN steps (an empty /etc/pip.conf mount point stays in the images).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=versions.env
source "$here/versions.env"

say() { printf '[build-images] %s\n' "$*" >&2; }
die() { printf '[build-images] ERROR: %s\n' "$*" >&2; exit 1; }

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/images"
mkdir -p "$cache_root"
t0=$SECONDS

step() {  # step NAME LOG CMD... : run CMD with its output in LOG; on failure name both
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
[[ $(id -u) -eq 0 ]] || die "must run as root (debootstrap and buildah's chroot builds need it)"
command -v apt-get >/dev/null || die "needs a Debian host with apt-get"
missing=()
for tool in buildah:buildah containerd:containerd debootstrap:debootstrap zstd:zstd flock:util-linux; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool#*:}")
done
if ((${#missing[@]})); then
  hostlog="$cache_root/host-packages.log"
  say "installing host packages: ${missing[*]} (log: $hostlog)"
  { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"; } \
    >"$hostlog" 2>&1 || die "step 'install host packages' failed: read $hostlog"
fi
command -v go >/dev/null || die "Go is needed to build the pause image (see README)"

version=$("$here/app-version.sh")
[[ -n "$version" ]] || die "hack/app-version.sh printed no version (charts/metaroce/Chart.yaml appVersion)"
# The chart's default image names, so that the chart runs these images unchanged.
AGENT_REF="ghcr.io/metaroce/metaroce-agent:$version"
OPERATOR_REF="ghcr.io/metaroce/metaroce-operator:$version"
RDMA_TEST_REF="localhost/metaroce-rdma-test:$version"
PAUSE_REF="localhost/metaroce-pause:$version"
# The agent's next version, only in the test nodes' containerd state: the e2e upgrades
# the transport library under a running pod with it (hack/next-agent-image.py).
AGENT_NEXT_REF="ghcr.io/metaroce/metaroce-agent:$version-next"

# The MetaRoCE transport the agent image carries (images/agent/transport, not in git).
say "staging the MetaRoCE transport (hack/stage-transport.sh)"
bash "$here/stage-transport.sh" >/dev/null || die "hack/stage-transport.sh failed (see above)"

# Every input of the images: the Dockerfiles and what they COPY (see images/*/Dockerfile).
inputs=(pyproject.toml README.md api operator node-agent hack/metaroce_harness cli images)
key=$( {
  grep -E '^(DEBIAN_SUITE|DEBIAN_MIRROR|IMAGE_)' "$here/versions.env"
  cat "$here/build-images.sh" "$here/next-agent-image.py"
  echo "version $version"
  (cd "$repo" && find "${inputs[@]}" -type f ! -name '*.pyc' ! -path '*/__pycache__/*' \
     ! -path '*.egg-info/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum)
} | sha256sum | cut -c1-12)
out="$cache_root/$key"

buildah=(buildah --root "$cache_root/storage" --runroot "$cache_root/run" --storage-driver overlay)

# Only one build at a time (they share buildah's storage); a second caller waits and
# then reuses the result.
exec 9>"$cache_root/.lock"
flock 9

if [[ -f "$out/.complete" ]]; then
  say "cached images: $out"
  echo "$out"
  exit 0
fi
say "building images $key (version $version, Debian $DEBIAN_SUITE)"
rm -rf "$out"
mkdir -p "$out/logs"
logs="$out/logs"
work="$out/work"
mkdir -p "$work"

# --- base image from a debootstrap root ----------------------------------------------
base_key=$(printf 'v1 %s %s %s\n' "$DEBIAN_SUITE" "$DEBIAN_MIRROR" "$IMAGE_BASE_VARIANT" | sha256sum | cut -c1-12)
BASE_REF="localhost/metaroce-base:$DEBIAN_SUITE-$base_key"
base_rootfs="$cache_root/rootfs/$base_key.tar.zst"
make_base() {
  local root="$work/base-root" c m
  if [[ ! -f "$base_rootfs" ]]; then
    mkdir -p "$cache_root/rootfs" "$cache_root/debs"
    debootstrap --variant="$IMAGE_BASE_VARIANT" --cache-dir="$cache_root/debs" \
      "$DEBIAN_SUITE" "$root" "$DEBIAN_MIRROR" || return 1
    # What a container base leaves out (like the official slim images).
    rm -rf "$root"/usr/share/{doc,man,info,locale} "$root"/var/cache/apt/*.bin \
           "$root"/var/lib/apt/lists/* "$root"/var/log/*
    mkdir -p "$root/usr/share/man" "$root/usr/share/doc"
    # Like Debian's docker images: no manuals or docs from later installs either.
    printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' \
      'path-exclude /usr/share/locale/*' >"$root/etc/dpkg/dpkg.cfg.d/docker-slim"
    tar -C "$root" --numeric-owner -cf - . | zstd -q -T0 -3 -o "$base_rootfs.tmp" || return 1
    mv "$base_rootfs.tmp" "$base_rootfs"
    rm -rf "$root"
  fi
  c=$("${buildah[@]}" from scratch) || return 1
  m=$("${buildah[@]}" mount "$c") || return 1
  zstd -dc "$base_rootfs" | tar -C "$m" --numeric-owner -xf - || return 1
  "${buildah[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd /bin/bash --label "io.metaroce.base=debootstrap $DEBIAN_SUITE $IMAGE_BASE_VARIANT" "$c" || return 1
  "${buildah[@]}" commit --rm "$c" "$BASE_REF"
}
if "${buildah[@]}" inspect --type image "$BASE_REF" >/dev/null 2>&1; then
  say "base image $BASE_REF: cached"
else
  step "base image $BASE_REF (debootstrap $DEBIAN_SUITE $IMAGE_BASE_VARIANT)" "$logs/base.log" make_base
fi

# --- the Dockerfiles -----------------------------------------------------------------
bud_args=(bud --isolation chroot --pull=never --layers)
cert=${PIP_CERT:-$(pip3 config get global.cert 2>/dev/null || true)}
if [[ -n "$cert" && -f "$cert" ]]; then
  mkdir -p "$work/pip"
  cp "$cert" "$work/pip/ca.crt"
  printf '[global]\ncert = /run/metaroce-build/ca.crt\n' >"$work/pip/pip.conf"
  bud_args+=(-v "$work/pip:/run/metaroce-build:ro" -v "$work/pip/pip.conf:/etc/pip.conf:ro")
  say "pip trusts $cert on this host: the RUN steps get it too"
fi
bud() {  # bud DOCKERFILE BASE REF
  (cd "$repo" && "${buildah[@]}" "${bud_args[@]}" --build-arg "BASE=$2" -f "$1" -t "$3" .)
}
step "agent image $AGENT_REF" "$logs/agent.log" bud images/agent/Dockerfile "$BASE_REF" "$AGENT_REF"
step "operator image $OPERATOR_REF" "$logs/operator.log" \
  bud images/operator/Dockerfile "$BASE_REF" "$OPERATOR_REF"
step "rdma-test image $RDMA_TEST_REF" "$logs/rdma-test.log" \
  bud images/rdma-test/Dockerfile "$AGENT_REF" "$RDMA_TEST_REF"

# --- pause ---------------------------------------------------------------------------
make_pause() {
  local c m
  (cd "$work" && CGO_ENABLED=0 GOTOOLCHAIN=local go build -trimpath -ldflags='-s -w' \
     -o "$work/pause" "$repo/images/pause/pause.go") || return 1
  c=$("${buildah[@]}" from scratch) || return 1
  m=$("${buildah[@]}" mount "$c") || return 1
  install -m 0755 "$work/pause" "$m/pause" || return 1
  "${buildah[@]}" config --entrypoint '["/pause"]' --cmd '' --user 65535:65535 "$c" || return 1
  "${buildah[@]}" commit --rm "$c" "$PAUSE_REF"
}
step "pause image $PAUSE_REF" "$logs/pause.log" make_pause

# --- export --------------------------------------------------------------------------
export_all() {
  local name ref
  for name in agent operator rdma-test pause; do
    case $name in
      agent) ref=$AGENT_REF ;; operator) ref=$OPERATOR_REF ;;
      rdma-test) ref=$RDMA_TEST_REF ;; pause) ref=$PAUSE_REF ;;
    esac
    rm -f "$out/$name.tar"
    "${buildah[@]}" push --quiet "$ref" "oci-archive:$out/$name.tar:$ref" || return 1
    echo "$name $ref $(stat -c %s "$out/$name.tar")"
  done
}
step "export OCI archives" "$logs/export.log" export_all

# buildah 1.28 ignores --disable-compression for oci-archive: gunzip the layers here
# (a layer's uncompressed digest is its diff_id, so the image config is unchanged), so
# that a TCG guest's `ctr image import` only untars them.
uncompress() {
  local name
  for name in agent operator rdma-test pause; do
    python3 - "$out/$name.tar" <<'PYEOF' || return 1
import gzip, hashlib, json, os, shutil, sys, tarfile, tempfile

archive = sys.argv[1]
work = tempfile.mkdtemp(dir=os.path.dirname(archive))
with tarfile.open(archive) as tar:
    tar.extractall(work, filter="tar")
blobs = os.path.join(work, "blobs", "sha256")


def blob(digest):
    return os.path.join(blobs, digest.split(":", 1)[1])


with open(os.path.join(work, "index.json")) as f:
    index = json.load(f)
for desc in index["manifests"]:
    with open(blob(desc["digest"])) as f:
        manifest = json.load(f)
    for layer in manifest["layers"]:
        if not layer["mediaType"].endswith("+gzip"):
            continue
        src, tmp = blob(layer["digest"]), os.path.join(blobs, "tmp")
        h, size = hashlib.sha256(), 0
        with gzip.open(src) as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(1 << 20):
                h.update(chunk)
                size += len(chunk)
                fout.write(chunk)
        os.rename(tmp, os.path.join(blobs, h.hexdigest()))
        if os.path.exists(src):  # two layers may share a blob
            os.unlink(src)
        layer.update(mediaType=layer["mediaType"][: -len("+gzip")],
                     digest="sha256:" + h.hexdigest(), size=size)
    data = json.dumps(manifest, separators=(",", ":")).encode()
    os.unlink(blob(desc["digest"]))
    digest = hashlib.sha256(data).hexdigest()
    with open(os.path.join(blobs, digest), "wb") as f:
        f.write(data)
    desc["digest"], desc["size"] = "sha256:" + digest, len(data)
with open(os.path.join(work, "index.json"), "w") as f:
    json.dump(index, f, separators=(",", ":"))
with tarfile.open(archive + ".tmp", "w") as tar:
    for name in ("oci-layout", "index.json", "blobs"):
        tar.add(os.path.join(work, name), arcname=name)
os.rename(archive + ".tmp", archive)
shutil.rmtree(work)
print(archive, os.path.getsize(archive))
PYEOF
  done
}
step "uncompress layers" "$logs/uncompress.log" uncompress
step "agent image, next version $AGENT_NEXT_REF" "$logs/agent-next.log" \
  python3 "$here/next-agent-image.py" "$out/agent.tar" "$repo/images/agent/transport" \
  "$AGENT_NEXT_REF" "$work/agent-next.tar"

# The test nodes' containerd state with the node images (pause, agent, rdma-test, and
# the agent's next version)
# already unpacked: under TCG, containerd's own unpack of the agent image takes many
# minutes, a tar of the result extracts in under one. Made by Debian's containerd on
# this host (the guests run the same package); the layer blobs are dropped once
# unpacked (the snapshots hold the files; nothing here is ever pushed).
node_state() {
  local root="$work/ctrd-root" state="$work/ctrd-state" sock="$work/ctrd.sock" pid rc=0 archive
  local ctr=(ctr --address "$sock" -n k8s.io)
  mkdir -p "$root" "$state"
  printf 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  snapshotter = "overlayfs"\n' \
    >"$work/ctrd.toml"
  containerd --config "$work/ctrd.toml" --root "$root" --state "$state" --address "$sock" \
    >"$logs/node-state-containerd.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 100); do "${ctr[@]}" version >/dev/null 2>&1 && break; sleep 0.2; done
  for archive in "$out"/{pause,agent,rdma-test}.tar "$work/agent-next.tar"; do
    "${ctr[@]}" images import "$archive" || { rc=1; break; }
  done
  if ((rc == 0)); then
    "${ctr[@]}" images ls
    # Layer blobs: every manifest's layers (configs and manifests stay).
    "${ctr[@]}" content ls -q | while read -r d; do
      "${ctr[@]}" content get "$d" | python3 -c '
import json, sys
try:
    m = json.load(sys.stdin)
except Exception:
    sys.exit(0)
for layer in m.get("layers", []) if isinstance(m, dict) else []:
    print(layer["digest"])' 2>/dev/null || true
    done | sort -u >"$work/layers.txt"
    xargs -r "${ctr[@]}" content rm <"$work/layers.txt" || rc=1
  fi
  kill "$pid"; wait "$pid" || true
  ((rc == 0)) || return 1
  # containerd's GC removes the files later; it is stopped already.
  while read -r d; do rm -f "$root/io.containerd.content.v1.content/blobs/sha256/${d#sha256:}"; done \
    <"$work/layers.txt"
  rm -rf "$root/tmpmounts" "$root"/io.containerd.runtime.* "$root"/io.containerd.grpc.v1.introspection
  tar -C "$root" --xattrs --xattrs-include='trusted.*' --numeric-owner -cf "$out/node-containerd.tar" . \
    || return 1
  rm -rf "$root" "$state"
}
step "node containerd state" "$logs/node-state.log" node_state

{
  echo "VERSION=$version"
  echo "NODE_CONTAINERD_STATE=node-containerd.tar"
  echo "BASE_REF=$BASE_REF"
  echo "AGENT_REF=$AGENT_REF"
  echo "OPERATOR_REF=$OPERATOR_REF"
  echo "RDMA_TEST_REF=$RDMA_TEST_REF"
  echo "PAUSE_REF=$PAUSE_REF"
  echo "AGENT_NEXT_REF=$AGENT_NEXT_REF"
  for name in agent operator rdma-test pause; do
    echo "ARCHIVE_${name//-/_}=$name.tar"
  done
  echo "BUILD_SECONDS=$((SECONDS - t0))"
} >"$out/manifest.env"
rm -rf "$work"
touch "$out/.complete"

# Keep the three newest finished builds; images no tag points at any more go from the
# storage (the layer cache of the current Dockerfiles stays).
# shellcheck disable=SC2012
mapfile -t finished < <(ls -1td "$cache_root"/*/.complete 2>/dev/null | tail -n +4)
for f in "${finished[@]}"; do
  d=${f%/.complete}
  [[ "$d" != "$out" ]] && rm -rf "$d"
done
for d in "$cache_root"/*/; do
  d=${d%/}
  [[ "${d##*/}" =~ ^[0-9a-f]{12}$ && ! -f "$d/.complete" ]] && rm -rf "$d"
done
say "done in $((SECONDS - t0)) s: $out ($(du -sh "$out" | cut -f1))"
echo "$out"
