"""The harness itself: warm start time, scale, clean teardown and clear failures."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from kubernetes import client

from metaroce_harness.cluster import BUILD_SCRIPT, FakeNode, LocalCluster

WARM_START_BUDGET_S = 20.0


def test_warm_start_is_fast_and_teardown_leaves_nothing() -> None:
    cluster = LocalCluster([FakeNode("solo-0")])
    cluster.start()
    try:
        assert cluster.ready_seconds is not None
        print(f"\n[harness] warm start to Ready with 1 node: {cluster.ready_seconds:.1f} s")
        assert cluster.ready_seconds <= WARM_START_BUDGET_S, (
            f"warm start took {cluster.ready_seconds:.1f} s (budget {WARM_START_BUDGET_S} s)"
        )
        assert "solo-0" in cluster.kubectl("get", "nodes").stdout
        workdir, podnet = cluster.workdir, cluster.pod_network
        pids = [c.process.pid for c in cluster.components]
    finally:
        cluster.stop()
    assert workdir is not None and not workdir.exists(), "temp dir left behind"
    assert podnet is not None
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert podnet.netns not in netns, "network namespace left behind"
    assert not Path(f"/sys/class/net/{podnet.host_if}").exists(), "veth left behind"
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _is_zombie(pid), f"process {pid} left running"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_a_thousand_kwok_nodes_become_ready() -> None:
    with LocalCluster() as cluster:
        nodes = [FakeNode(f"scale-{i:04d}", labels={"pool": "scale"}) for i in range(1000)]
        seconds = cluster.add_nodes(nodes, timeout=300)
        print(f"\n[harness] 1000 kwok nodes created and Ready in {seconds:.1f} s")
        ready = cluster.ready_nodes(client.CoreV1Api(cluster.api_client()))
        assert len({n for n in ready if n.startswith("scale-")}) == 1000


def _build_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    # A fresh cache so the build script cannot reuse the real one.
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **extra}


def test_build_script_without_go_says_so(tmp_path: Path) -> None:
    go = shutil.which("go")
    assert go is not None
    path = ":".join(p for p in os.environ["PATH"].split(":") if not Path(p, "go").exists())
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        env=_build_env(tmp_path, PATH=path),
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0
    assert "Go is not installed" in proc.stderr


def test_build_script_with_unreachable_proxy_says_so_in_one_line(tmp_path: Path) -> None:
    env = _build_env(tmp_path, GOPROXY="off", GOMODCACHE=str(tmp_path / "mod"), GOFLAGS="")
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], env=env, capture_output=True, text=True)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "module proxy" in errors[0], proc.stderr
    shutil.rmtree(tmp_path / "mod", ignore_errors=True)


def test_sigterm_tears_the_cluster_down_and_ends_the_process() -> None:
    from metaroce_harness.cluster import leftovers

    code = (
        "import time\n"
        "from metaroce_harness.cluster import LocalCluster\n"
        "LocalCluster().start()\n"
        "print('up', flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "up"
    running = leftovers(proc.pid)
    pids = [int(item.split()[1]) for item in running if item.startswith("process ")]
    assert len(pids) == 5, f"the child's cluster should be running: {running}"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM, "SIGTERM must end the process, after teardown"
    assert leftovers(proc.pid) == []
    # Orphans would be re-parented, so check the component pids themselves too.
    assert [pid for pid in pids if Path(f"/proc/{pid}").exists() and not _is_zombie(pid)] == []
