#!/usr/bin/env bash
# Build the pinned Kubernetes binaries (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kubectl, kubelet, kwok, helm) from the Go module proxy into
#   ${XDG_CACHE_HOME:-~/.cache}/metaroce/k8s/<key>/bin
# where <key> hashes this script's pins in hack/versions.env and the script itself. Idempotent: a finished build is
# reused. Prints the bin directory on its last line of stdout.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

cache_root="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce"
# Keyed on the pins this script uses (not the guest's), so a guest pin change does not
# rebuild Kubernetes.
key=$( { grep -E '^(KUBERNETES|ETCD|KWOK|HELM)_' "$here/versions.env"; cat "$here/build-k8s.sh"; } \
  | sha256sum | cut -c1-12)
out="$cache_root/k8s/$key"
bin="$out/bin"
logs="$out/logs"

say() { printf '[build-k8s] %s\n' "$*" >&2; }
die() { printf '[build-k8s] ERROR: %s\n' "$*" >&2; exit 1; }

if [[ -f "$out/.complete" ]]; then
  say "cached: $bin"
  echo "$bin"
  exit 0
fi

command -v go >/dev/null || die "Go is not installed (needed to build Kubernetes from source); install Go >= 1.26 and re-run"
command -v python3 >/dev/null || die "python3 is needed to read go.mod replace directives"

mkdir -p "$bin" "$logs"
export GOFLAGS="-mod=mod -buildvcs=false -trimpath"
export CGO_ENABLED=0
export GOTOOLCHAIN=local

# One clear line when the module proxy is unreachable, instead of a wall of Go errors.
if ! go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" >"$logs/probe.json" 2>"$logs/probe.err"; then
  die "the Go module proxy ($(go env GOPROXY)) is unreachable or refused k8s.io/kubernetes@$KUBERNETES_VERSION: see $logs/probe.err"
fi

# module_dir MODULE@VERSION: where the Go module cache unpacked that module.
module_dir() { go mod download -json "$1" | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])'; }

# wrapper_module DIR MODULE VERSION LOCAL_REPLACE_VERSION
# A module with replace directives cannot be `go install`ed, so build it from a wrapper
# module that requires it and re-states its replaces, turning local-path replaces
# (./staging/src/k8s.io/api, ../api) into the released versions of those modules.
wrapper_module() {
  local dir=$1 mod=$2 ver=$3 local_ver=$4
  rm -rf "$dir"; mkdir -p "$dir"
  local gomod
  gomod=$(go mod download -json "$mod@$ver" | python3 -c 'import json,sys; print(json.load(sys.stdin)["GoMod"])')
  (
    cd "$dir"
    go mod init "metaroce.local/build/$(basename "$dir")" >/dev/null 2>&1
    go mod edit -require="$mod@$ver"
    go mod edit -json "$gomod" | python3 -c '
import json, sys
local_ver = sys.argv[1]
for r in json.load(sys.stdin).get("Replace") or []:
    old, new = r["Old"], r["New"]
    lhs = old["Path"] + ("@" + old["Version"] if old.get("Version") else "")
    if new.get("Version"):
        print(f"-replace={lhs}={new['"'"'Path'"'"']}@{new['"'"'Version'"'"']}")
    else:  # a path inside the source tree: use the module released with it
        print(f"-replace={lhs}={old['"'"'Path'"'"']}@{local_ver}")
' "$local_ver" | xargs -r go mod edit
  )
}

# build NAME DIR LDFLAGS PACKAGE: one main package into $bin/NAME.
build() {
  local name=$1 dir=$2 ldflags=$3 pkg=$4
  local start=$SECONDS
  say "building $name ($pkg) ... log: $logs/$name.log"
  if ! (cd "$dir" && go build -ldflags "-s -w $ldflags" -o "$bin/$name" "$pkg") >"$logs/$name.log" 2>&1; then
    tail -n 20 "$logs/$name.log" >&2
    die "building $name failed: read $logs/$name.log"
  fi
  say "built $name in $((SECONDS - start)) s"
  echo "$name $((SECONDS - start))" >>"$out/build-times.txt"
}

work="$out/src"
: >"$out/build-times.txt"

# --- Kubernetes ---------------------------------------------------------------------
kv=$KUBERNETES_VERSION; kmaj=${kv#v}; kmaj=${kmaj%%.*}; kmin=${kv#v*.}; kmin=${kmin%%.*}
wrapper_module "$work/kubernetes" k8s.io/kubernetes "$kv" "$KUBERNETES_STAGING_VERSION"
kflags="-X k8s.io/component-base/version.gitVersion=$kv -X k8s.io/component-base/version.gitMajor=$kmaj -X k8s.io/component-base/version.gitMinor=$kmin -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
kflags="$kflags -X k8s.io/client-go/pkg/version.gitVersion=$kv -X k8s.io/client-go/pkg/version.gitMajor=$kmaj -X k8s.io/client-go/pkg/version.gitMinor=$kmin"
build kube-apiserver "$work/kubernetes" "$kflags" k8s.io/kubernetes/cmd/kube-apiserver
build kube-controller-manager "$work/kubernetes" "$kflags" k8s.io/kubernetes/cmd/kube-controller-manager
build kube-scheduler "$work/kubernetes" "$kflags" k8s.io/kubernetes/cmd/kube-scheduler
build kubectl "$work/kubernetes" "$kflags" k8s.io/kubernetes/cmd/kubectl
build kubelet "$work/kubernetes" "$kflags" k8s.io/kubernetes/cmd/kubelet

# --- etcd ---------------------------------------------------------------------------
wrapper_module "$work/etcd" go.etcd.io/etcd/server/v3 "$ETCD_VERSION" "$ETCD_VERSION"
build etcd "$work/etcd" "-X go.etcd.io/etcd/api/v3/version.GitSHA=${ETCD_VERSION}" go.etcd.io/etcd/server/v3

# --- kwok and helm ------------------------------------------------------------------
wrapper_module "$work/kwok" sigs.k8s.io/kwok "$KWOK_VERSION" "$KWOK_VERSION"
build kwok "$work/kwok" "-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" sigs.k8s.io/kwok/cmd/kwok
wrapper_module "$work/helm" helm.sh/helm/v3 "$HELM_VERSION" "$HELM_VERSION"
build helm "$work/helm" "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" helm.sh/helm/v3/cmd/helm

# --- data files from the same pinned modules ----------------------------------------
# kwok alone (without kwokctl) needs Stage objects to drive node and pod lifecycles:
# the same defaults kwokctl embeds (initialize + lease heartbeat, pod ready/complete/delete).
kwok_dir=$(module_dir "sigs.k8s.io/kwok@$KWOK_VERSION")
for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
         pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
  cat "$kwok_dir/kustomize/stage/$f"; echo "---"
done >"$out/kwok-stages.yaml"
# The kubelet device-plugin API, to check the project's copy of api.proto against.
kubelet_dir=$(module_dir "k8s.io/kubelet@$KUBERNETES_STAGING_VERSION")
cp "$kubelet_dir/pkg/apis/deviceplugin/v1beta1/api.proto" "$out/deviceplugin-v1beta1-api.proto"
chmod u+w "$out"/*.yaml "$out"/*.proto

# --- verify -------------------------------------------------------------------------
say "verifying versions"
check() {  # check NAME EXPECTED CMD...
  local name=$1 want=$2; shift 2
  local got
  got=$("$@" 2>&1 | head -n 3 | tr '\n' ' ') || die "$name --version failed: $got"
  [[ "$got" == *"$want"* ]] || die "$name reports '$got', expected it to contain '$want'"
  say "  $name: $want"
}
check kube-apiserver "$kv" "$bin/kube-apiserver" --version
check kube-controller-manager "$kv" "$bin/kube-controller-manager" --version
check kube-scheduler "$kv" "$bin/kube-scheduler" --version
check kubelet "$kv" "$bin/kubelet" --version
check kubectl "$kv" "$bin/kubectl" version --client
check etcd "${ETCD_VERSION#v}" "$bin/etcd" --version
check kwok "${KWOK_VERSION#v}" "$bin/kwok" --version
check helm "$HELM_VERSION" "$bin/helm" version --short

rm -rf "$work"  # sources live in the Go module cache; keep only binaries and logs
touch "$out/.complete"
say "done: $bin"
echo "$bin"
