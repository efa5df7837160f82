#!/usr/bin/env bash
# Create the kind cluster of docs/kind.md, load the project's images into it and print
# the environment the e2e tests take. Needs docker, kind and kubectl, run where the
# Docker host can load rdma_rxe (see docs/kind.md).
#   hack/kind/up.sh            # create (or reuse) the cluster "metaroce"
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
name=metaroce

die() { printf '[kind] ERROR: %s\n' "$*" >&2; exit 1; }
for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || die "$tool is not installed"
done
# SoftRoCE lives in the (shared) host kernel, not in the node containers.
if [[ ! -d /sys/module/rdma_rxe ]]; then
  sudo modprobe rdma_rxe || die "cannot load rdma_rxe on the Docker host (linux-modules-extra?)"
fi
sudo modprobe configfs 2>/dev/null || true
mountpoint -q /sys/kernel/config || sudo mount -t configfs none /sys/kernel/config

kind get clusters | grep -qx "$name" || kind create cluster --config "$here/cluster.yaml"

version=$("$repo/hack/app-version.sh")
agent=ghcr.io/metaroce/metaroce-agent:$version
operator=ghcr.io/metaroce/metaroce-operator:$version
rdma_test=localhost/metaroce-rdma-test:$version
docker build -f "$repo/images/agent/Dockerfile" -t "$agent" "$repo"
docker build -f "$repo/images/operator/Dockerfile" -t "$operator" "$repo"
docker build -f "$repo/images/rdma-test/Dockerfile" --build-arg "BASE=$agent" -t "$rdma_test" "$repo"
kind load docker-image --name "$name" "$agent" "$operator" "$rdma_test"

kubeconfig="$repo/.kind-$name.kubeconfig"
kind get kubeconfig --name "$name" >"$kubeconfig"
workers=$(kubectl --kubeconfig "$kubeconfig" get nodes -l metaroce.io/e2e=true \
  -o jsonpath='{range .items[*]}{.metadata.name}{","}{end}')
echo "export METAROCE_E2E_KUBECONFIG=$kubeconfig"
echo "export METAROCE_E2E_NODES=${workers%,}"
