"""The demo: the project's main job, end to end on one machine.

Starts the local control plane with a few simulated nodes, installs the CRDs, and
prints a readable summary. Each later piece (operator, sample network, SoftRoCE
guests running real agents) is one more step here, so the demo shows what the tests
check.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence

from metaroce_harness.cluster import REPO_ROOT, FakeNode, HarnessError, LocalCluster

log = logging.getLogger("metaroce.demo")

DEMO_NODES = [
    FakeNode("gpu-node-0", labels={"metaroce.io/rdma": "true", "topology.kubernetes.io/zone": "a"}),
    FakeNode("gpu-node-1", labels={"metaroce.io/rdma": "true", "topology.kubernetes.io/zone": "a"}),
    FakeNode("gpu-node-2", labels={"metaroce.io/rdma": "true", "topology.kubernetes.io/zone": "b"}),
    FakeNode("cpu-node-0", labels={"topology.kubernetes.io/zone": "b"}),
]


def step(title: str) -> float:
    print(f"==> {title}", flush=True)
    return time.monotonic()


def run_demo(cluster: LocalCluster) -> None:
    t = step("installing the CRDs (kubectl apply --server-side -f crds/)")
    cluster.kubectl("apply", "--server-side", "-f", str(REPO_ROOT / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")
    print(f"    done in {time.monotonic() - t:.1f} s")
    step("summary")
    print(cluster.kubectl("get", "nodes", "-L", "metaroce.io/rdma").stdout)
    print(cluster.kubectl("get", "crds").stdout)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hack/demo.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the cluster up until Ctrl-C")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="    %(message)s")
    try:
        t = step(f"starting the local control plane with {len(DEMO_NODES)} simulated nodes")
        with LocalCluster(DEMO_NODES) as cluster:
            print(f"    ready in {time.monotonic() - t:.1f} s; KUBECONFIG={cluster.kubeconfig}")
            run_demo(cluster)
            if args.keep:
                print("cluster kept up; Ctrl-C stops it and removes everything it made")
                signal.pause()
    except KeyboardInterrupt:
        return 0
    except HarnessError as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
