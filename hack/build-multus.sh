#!/usr/bin/env bash
# Build the pinned Multus CNI meta-plugin (the "thin" plugin: one `multus` binary that
# the container runtime execs, no daemon) from its Go module into
#   ${XDG_CACHE_HOME:-~/.cache}/metaroce/multus/<key>/bin/multus
# where <key> hashes MULTUS_VERSION in hack/versions.env and this script. Idempotent: a
# finished build is reused. Prints the bin directory on its last line of stdout; the
# NetworkAttachmentDefinition CRD of the same version is beside it (../nad-crd.yaml).
#
# Only cmd/multus is built: the real-node guests exec it from their CNI bin dir, and
# everything else Multus ships (daemon, shim, entrypoints, cert-approver) is for
# installing it as a DaemonSet, which the harness does itself. `go install mod@version`
# is refused here (it asks the proxy for the module's version list, which answers 403),
# so it is built from a wrapper module that requires exactly the pinned version (the
# module has no replace directives, so the build list is Multus's own); the proxy's
# module zip carries only vendor/modules.txt, not the vendored sources, so -mod=mod.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce"
key=$( { grep -E '^MULTUS_' "$here/versions.env"; cat "$here/build-multus.sh"; } | sha256sum | cut -c1-12)
out="$cache_root/multus/$key"
bin="$out/bin"

say() { printf '[build-multus] %s\n' "$*" >&2; }
die() { printf '[build-multus] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -f "$out/.complete" ]]; then
  say "cached: $bin"
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || die "Go is not installed (needed to build Multus from source); install Go >= 1.26 and re-run"

mod=gopkg.in/k8snetworkplumbingwg/multus-cni.v4
mkdir -p "$bin"
export GOFLAGS="-mod=mod -buildvcs=false -trimpath"
export CGO_ENABLED=0
export GOTOOLCHAIN=local

start=$SECONDS
say "building multus $MULTUS_VERSION ($mod/cmd/multus) ... log: $out/build.log"
ldflags="-s -w -X $mod/pkg/multus.version=$MULTUS_VERSION -X $mod/pkg/multus.commit=$MULTUS_VERSION"
ldflags="$ldflags -X $mod/pkg/multus.gitTreeState=clean -X $mod/pkg/multus.releaseStatus=released"
ldflags="$ldflags -X $mod/pkg/multus.date=1970-01-01T00:00:00Z"
work="$out/src"
rm -rf "$work"; mkdir -p "$work"
if ! (cd "$work" && go mod init metaroce.local/build/multus && go mod edit -require="$mod@$MULTUS_VERSION" \
      && go build -ldflags "$ldflags" -o "$bin/multus" "$mod/cmd/multus") >"$out/build.log" 2>&1; then
  tail -n 20 "$out/build.log" >&2
  die "building multus failed (is the Go module proxy $(go env GOPROXY) reachable?): read $out/build.log"
fi
echo "multus $((SECONDS - start))" >"$out/build-times.txt"
# Multus's own NetworkAttachmentDefinition CRD, from the same pinned module (the harness
# installs it as a cluster prerequisite; the metaroce chart does not ship it).
mod_dir=$(go mod download -json "$mod@$MULTUS_VERSION" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
python3 - "$mod_dir/deployments/multus-daemonset.yml" >"$out/nad-crd.yaml" <<'PY'
import sys
docs = open(sys.argv[1]).read().split("\n---")
crd = [d for d in docs if "kind: CustomResourceDefinition" in d]
if len(crd) != 1:
    sys.exit(f"expected one CustomResourceDefinition in {sys.argv[1]}, found {len(crd)}")
print(crd[0].strip("-\n"))
PY
got=$("$bin/multus" -version 2>&1 | head -n 1) || die "multus -version failed: $got"
[[ "$got" == *"version:$MULTUS_VERSION("* ]] || die "multus reports '$got', expected version $MULTUS_VERSION"
say "built multus in $((SECONDS - start)) s: $got"
rm -rf "$work"  # sources live in the Go module cache
touch "$out/.complete"
echo "$bin"
