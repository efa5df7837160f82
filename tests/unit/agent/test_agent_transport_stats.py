"""The MetaRoCE transport's stats files (issue 14 item 7): per-allocation directories made
by `Allocate`, read with O_NOFOLLOW and bounded sizes, attributed to containers through
the PodResources API (real gRPC), exported per pod, and the real library writing them."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import make_config
from fakes import FixtureHost

from metaroce_agent.deviceplugin import DevicePlugin, PluginConfig
from metaroce_agent.deviceplugin.devices import (
    ContainerAllocation,
    Mount,
    PluginDevice,
    with_stats_dir,
)
from metaroce_agent.deviceplugin.podresources import (
    podresources_pb2,
    units_by_container,
)
from metaroce_agent.exporter import AgentMetrics, TransportStatsCollector
from metaroce_agent.loop import Agent, AgentOptions
from metaroce_agent.transport.stats import (
    MAX_FILE_BYTES,
    SCHEMA,
    STATS_CONTAINER_DIR,
    AllocationRecord,
    ContainerRef,
    StatsDirectories,
    TransportStats,
    attribute,
    read_directory,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deviceplugin"))
from kubelet_peer import KubeletPeer, PodResourcesLister, serve_pod_resources

REPO = Path(__file__).resolve().parents[3]
NETWORK = "lossy"
RESOURCE = "metaroce.io/lossy"
STATE = "/run/metaroce/agent"


def snapshot(
    *,
    pid: int = 7,
    unix_ms: int | None = None,
    closed: bool = False,
    paths: list[dict[str, Any]] | None = None,
    **counters: int,
) -> dict[str, Any]:
    base = {"retransmits": 0, "bytes_sent": 0, "bytes_rcvd": 0, "ce_rcvd": 0, "rtos": 0}
    return {
        "schema": SCHEMA,
        "pid": pid,
        "local": "udp://10.0.0.1:20000",
        "unix_ms": int(time.time() * 1000) if unix_ms is None else unix_ms,
        "uptime_us": 1,
        "closed": closed,
        "counters": {**base, **counters},
        "io": {"tx_dropped_local": 0, "tx_errors": 0, "rx_errors": 0},
        "peers": [{"addr": "udp://10.0.0.2:20000", "paths": paths or []}],
    }


def path(p: int, srtt: int, cwnd: int, failed: bool = False) -> dict[str, Any]:
    return {"path": p, "failed": failed, "cwnd": cwnd, "srtt_us": srtt, "min_rtt_us": srtt // 2}


def write(d: Path, name: str, doc: dict[str, Any] | str) -> None:
    (d / name).write_text(doc if isinstance(doc, str) else json.dumps(doc))


# --- reading: what a pod can plant is refused, counted, never followed --------------------------


def test_a_good_file_is_read(tmp_path: Path) -> None:
    write(tmp_path, "ep-1-20000.json", snapshot(retransmits=3, paths=[path(0, 100, 10)]))
    got, refused = read_directory(str(tmp_path))
    assert not refused
    assert got["ep-1-20000.json"].counters["retransmits"] == 3
    assert got["ep-1-20000.json"].paths[0].srtt_us == 100


def test_symlinks_fifos_oversize_and_bad_files_are_refused_by_reason(tmp_path: Path) -> None:
    outside = tmp_path / "host-secret.json"
    write(tmp_path, "host-secret.json", snapshot(retransmits=99))
    d = tmp_path / "alloc"
    d.mkdir()
    (d / "ep-1-1.json").symlink_to(outside)
    os.mkfifo(d / "ep-2-2.json")  # O_NONBLOCK: no hang
    (d / "ep-3-3.json").write_bytes(b" " * (MAX_FILE_BYTES + 1))
    write(d, "ep-4-4.json", '{"schema": "metaroce.io/stats/v1", "pid": ')
    write(d, "ep-5-5.json", {**snapshot(), "schema": "metaroce.io/stats/v0"})
    write(d, "ep-6-6.json", snapshot(retransmits=-1))
    bad_counter = snapshot()
    bad_counter["counters"]["retransmits"] = "many"
    write(d, "ep-7-7.json", bad_counter)
    write(d, "ep-8-8.json", {**snapshot(), "closed": "yes"})
    (d / "ep-9-9.json").mkdir()
    write(d, "ep-10-10.json", snapshot(retransmits=1))
    write(d, "notes.txt", "not a stats file: ignored")
    t0 = time.monotonic()
    got, refused = read_directory(str(d))
    assert time.monotonic() - t0 < 2
    assert list(got) == ["ep-10-10.json"]
    assert dict(refused) == {
        "symlink": 1,
        "not-regular": 2,
        "oversize": 1,
        "bad-json": 1,
        "bad-schema": 4,
    }


def test_a_symlinked_directory_is_refused_and_files_are_capped(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    for i in range(5):
        write(real, f"ep-{i}-1.json", snapshot())
        os.utime(real / f"ep-{i}-1.json", (1000 + i, 1000 + i))
    (tmp_path / "link").symlink_to(real)
    got, refused = read_directory(str(tmp_path / "link"))
    assert not got and dict(refused) == {"symlink": 1}
    got, refused = read_directory(str(real), max_files=3)
    assert sorted(got) == ["ep-2-1.json", "ep-3-1.json", "ep-4-1.json"]  # the newest
    assert dict(refused) == {"too-many": 2}
    assert read_directory(str(tmp_path / "missing")) == ({}, {})


# --- attribution ---------------------------------------------------------------------------------


def test_each_container_gets_its_newest_allocation() -> None:
    a, b = ContainerRef("jobs", "a", "train"), ContainerRef("jobs", "b", "train")
    records = {
        "old": AllocationRecord(frozenset({"eth1-0"}), 100.0),  # pod gone; unit re-used
        "new": AllocationRecord(frozenset({"eth1-0"}), 200.0),
        "two": AllocationRecord(frozenset({"eth1-1", "eth2-1"}), 150.0),
        "gone": AllocationRecord(frozenset({"eth1-3"}), 50.0),
    }
    got = attribute(records, {a: frozenset({"eth1-0"}), b: frozenset({"eth1-1", "eth2-1"})})
    assert got.owners == {"new": a, "two": b}
    assert got.unowned == ("gone", "old")


# --- the directories: Allocate makes them, the agent removes the unowned -----------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_directories_are_per_allocation_and_removed_after_the_grace(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path)
    clock = Clock()
    dirs = StatsDirectories(host, STATE, NETWORK, clock=clock, grace=60)
    first = dirs.create(["eth1-0"])
    second = dirs.create(["eth1-1"])
    assert first != second and first.startswith(f"{STATE}/{NETWORK}/stats/")
    root = host.path(f"{STATE}/{NETWORK}/stats")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == 0
    assert stat.S_IMODE(host.path(first).stat().st_mode) == 0o777
    records = dirs.records()
    assert {r.units for r in records.values()} == {frozenset({"eth1-0"}), frozenset({"eth1-1"})}
    stray = root / "1-stray"  # a directory whose record was lost
    stray.mkdir()
    (stray / "junk").symlink_to("/etc/passwd")
    a = ContainerRef("jobs", "a", "train")
    owned = attribute(dirs.records(), {a: frozenset({"eth1-0"})})
    assert dirs.remove_unowned(owned) == []  # within the grace
    clock.now += 61
    assert sorted(dirs.remove_unowned(owned)) == sorted(["1-stray", second.rsplit("/", 1)[1]])
    assert host.path(first).is_dir() and not host.path(second).exists()
    assert Path("/etc/passwd").exists()
    assert set(dirs.records()) == {first.rsplit("/", 1)[1]}


def test_with_stats_dir_mounts_it_read_write_and_appends_to_mr_config() -> None:
    got = ContainerAllocation(
        devices=(), envs={"MR_CONFIG": "ports=1-2", "X": "y"}, mounts=(Mount("/opt/x", "/h/x"),)
    )
    out = with_stats_dir(got, "/run/metaroce/agent/n/stats/1-ab")
    assert out.envs["MR_CONFIG"] == f"ports=1-2,stats_dir={STATS_CONTAINER_DIR}"
    assert out.envs["MR_STATS_DIR"] == STATS_CONTAINER_DIR and out.envs["X"] == "y"
    assert out.mounts[-1] == Mount(STATS_CONTAINER_DIR, "/run/metaroce/agent/n/stats/1-ab", False)
    assert with_stats_dir(ContainerAllocation(()), "/d").envs["MR_CONFIG"] == (
        f"stats_dir={STATS_CONTAINER_DIR}"
    )


def test_allocate_over_grpc_gives_each_container_its_own_directory(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path / "root")
    dirs = StatsDirectories(host, STATE, NETWORK)
    lib = "/run/metaroce/transport/lossy/0.1.0-abab"
    unit = PluginDevice(
        rdma_device="eth1", uverbs="", netdev="eth1", numa_node=0, port_active=True,
        qos_verified=True, rdma_cm=False, library_dir=lib,
        env=(("MR_CONFIG", "ports=20000-23999"),),
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="dps-") as d:
        kubelet = KubeletPeer(Path(d))
        kubelet.start()
        plugin = DevicePlugin(
            PluginConfig(
                resource_name=RESOURCE, pods_per_device=2, socket_dir=Path(d),
                poll_interval=0.1, stats_dir_for=dirs.create,
            )
        )  # fmt: skip
        try:
            plugin.update([unit])
            plugin.start()
            kubelet.wait("2 units", lambda: len(kubelet.healthy(RESOURCE)) == 2)
            one, two = kubelet.allocate(RESOURCE, ["eth1-0"], ["eth1-1"]).container_responses
        finally:
            plugin.stop()
            kubelet.stop()
    mounts = [[(m.container_path, m.host_path, m.read_only) for m in r.mounts] for r in (one, two)]
    assert mounts[0][0] == ("/opt/metaroce-transport", lib, True)
    (_, first, ro1), (_, second, ro2) = mounts[0][1], mounts[1][1]
    assert first != second and not ro1 and not ro2
    assert host.path(first).is_dir() and host.path(second).is_dir()
    assert dict(one.envs)["MR_CONFIG"] == f"ports=20000-23999,stats_dir={STATS_CONTAINER_DIR}"
    assert {r.units for r in dirs.records().values()} == {
        frozenset({"eth1-0"}),
        frozenset({"eth1-1"}),
    }


# --- export -------------------------------------------------------------------------------------


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of `name` whose labels include `labels`."""
    found = []
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}\{{(.*)\}} (\S+)", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            found.append(float(m.group(2)))
    assert len(found) == 1, f"{name} {labels}: {found}\n{text}"
    return found[0]


def test_the_exporter_serves_per_container_counters_and_path_aggregates(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path)
    dirs = StatsDirectories(host, STATE, NETWORK)
    first = host.path(dirs.create(["eth1-0"]))
    unowned = host.path(dirs.create(["eth1-9"]))
    weird = ContainerRef("jobs", "a", 'tr"ain\\x\n')  # escaped, not broken
    held = {weird: frozenset({"eth1-0"})}
    stats = TransportStats(dirs, lambda: held, refresh_s=0)
    metrics = AgentMetrics(NETWORK, "node-1")
    metrics.add_transport_stats(TransportStatsCollector(NETWORK, stats))
    now = int(time.time() * 1000)
    paths = [path(0, 100, 10), path(1, 300, 30), path(2, 9999, 1, failed=True)]
    write(first, "ep-1-20000.json", snapshot(unix_ms=now - 1000, bytes_rcvd=0, paths=paths))
    write(first, "ep-2-20016.json", snapshot(pid=2, closed=True, retransmits=5, rtos=1))
    write(first, "ep-3-20032.json", "{")
    write(unowned, "ep-9-20000.json", snapshot(retransmits=1000))
    metrics.render()
    write(
        first,
        "ep-1-20000.json",
        snapshot(unix_ms=now, retransmits=2, ce_rcvd=4, bytes_rcvd=10_000_000, paths=paths),
    )
    text = metrics.render().decode()
    lbl = {"network": NETWORK, "namespace": "jobs", "pod": "a"}
    assert 'container="tr\\"ain\\\\x\\n"' in text
    assert metric(text, "metaroce_transport_retransmits_total", **lbl) == 7
    assert metric(text, "metaroce_transport_rtos_total", **lbl) == 1
    assert metric(text, "metaroce_transport_ce_received_total", **lbl) == 4
    assert metric(text, "metaroce_transport_bytes_received_total", **lbl) == 10_000_000
    goodput = metric(
        text, "metaroce_transport_goodput_bytes_per_second", direction="received", **lbl
    )
    assert goodput == pytest.approx(10_000_000)
    assert metric(text, "metaroce_transport_path_srtt_microseconds", stat="max", **lbl) == 300
    assert metric(text, "metaroce_transport_path_srtt_microseconds", stat="mean", **lbl) == 200
    assert metric(text, "metaroce_transport_path_cwnd_packets", stat="min", **lbl) == 10
    assert metric(text, "metaroce_transport_paths", state="failed", **lbl) == 1
    assert metric(text, "metaroce_transport_endpoints", state="closed", **lbl) == 1
    assert metric(text, "metaroce_transport_stats_files_refused_total", reason="bad-json") == 2
    assert metric(text, "metaroce_transport_stats_unowned_allocations") == 1
    # the same snapshot scraped again keeps the measured goodput
    again = metrics.render().decode()
    assert metric(
        again, "metaroce_transport_goodput_bytes_per_second", direction="received", **lbl
    ) == pytest.approx(10_000_000)


def test_sent_goodput_counts_acknowledged_bytes_not_retransmits(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path)
    dirs = StatsDirectories(host, STATE, NETWORK)
    first = host.path(dirs.create(["eth1-0"]))
    held = {ContainerRef("jobs", "a", "train"): frozenset({"eth1-0"})}
    metrics = AgentMetrics(NETWORK, "node-1")
    metrics.add_transport_stats(
        TransportStatsCollector(NETWORK, TransportStats(dirs, lambda: held, refresh_s=0))
    )
    now = int(time.time() * 1000)
    write(first, "ep-1-20000.json", snapshot(unix_ms=now - 1000, bytes_acked=0))
    metrics.render()
    # 20 MB went out in the second, 8 MB of it new: the rest were retransmits
    write(
        first,
        "ep-1-20000.json",
        snapshot(unix_ms=now, bytes_sent=20_000_000, bytes_acked=8_000_000),
    )
    text = metrics.render().decode()
    lbl = {"network": NETWORK, "namespace": "jobs", "pod": "a"}
    goodput = metric(text, "metaroce_transport_goodput_bytes_per_second", direction="sent", **lbl)
    assert goodput == pytest.approx(8_000_000)
    assert metric(text, "metaroce_transport_bytes_acked_total", **lbl) == 8_000_000


def test_no_kubelet_answer_keeps_the_last_attribution(tmp_path: Path) -> None:
    host = FixtureHost(tmp_path)
    dirs = StatsDirectories(host, STATE, NETWORK)
    d = host.path(dirs.create(["eth1-0"]))
    write(d, "ep-1-1.json", snapshot(retransmits=1))
    answers: list[Any] = [{ContainerRef("jobs", "a", "c"): frozenset({"eth1-0"})}]

    def holders() -> Any:
        if not answers:
            raise RuntimeError("kubelet down")
        return answers.pop()

    stats = TransportStats(dirs, holders, refresh_s=0)
    assert [c.ref.pod for c in stats.read()[0]] == ["a"]
    assert [c.ref.pod for c in stats.read()[0]] == ["a"]
    assert stats.attribution_errors == 1 and "kubelet down" in stats.last_error


# --- the real library writes, the agent reads (real PodResources gRPC too) ---------------


def pod(name: str, units: list[str]) -> Any:
    return podresources_pb2.PodResources(
        name=name,
        namespace="jobs",
        containers=[
            podresources_pb2.ContainerResources(
                name="train",
                devices=[
                    podresources_pb2.ContainerDevices(resource_name=RESOURCE, device_ids=units)
                ],
            )
        ],
    )


@pytest.fixture
def pod_resources() -> Iterator[tuple[str, PodResourcesLister]]:
    with serve_pod_resources("prs-") as served:
        yield served


@pytest.fixture(scope="session")
def release() -> Path:
    """The real transport's build (hack/build-transport.sh: warm, it only prints it)."""
    res = subprocess.run(
        ["bash", str(REPO / "hack/build-transport.sh")], capture_output=True, text=True, check=False
    )
    assert res.returncode == 0, f"hack/build-transport.sh failed:\n{res.stderr[-2000:]}"
    out = Path(res.stdout.strip().splitlines()[-1])
    assert (out / "metaroce-perf").is_file(), f"no metaroce-perf in {out}"
    return out


def in_container(host_dir: Path, argv: list[str]) -> list[str]:
    """`argv` as an unprivileged user (nobody) that sees the allocation directory only
    through a bind mount at STATS_CONTAINER_DIR, as a container does."""
    script = (
        f"mkdir -p {STATS_CONTAINER_DIR} && mount --bind {host_dir} {STATS_CONTAINER_DIR} && "
        'exec setpriv --reuid 65534 --regid 65534 --clear-groups "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *argv]


def test_the_real_library_writes_what_the_agent_exports(
    tmp_path: Path, release: Path, pod_resources: tuple[str, PodResourcesLister]
) -> None:
    sock, lister = pod_resources
    host = FixtureHost(tmp_path / "root")
    dirs = StatsDirectories(host, STATE, NETWORK)
    server_dir = host.path(dirs.create(["eth1-0"]))
    client_dir = host.path(dirs.create(["eth1-1"]))
    lister.pods = [pod("server", ["eth1-0"]), pod("client", ["eth1-1"])]

    def holders() -> Any:
        return {ContainerRef(*k): v for k, v in units_by_container(RESOURCE, sock).items()}

    stats = TransportStats(dirs, holders, refresh_s=0)
    metrics = AgentMetrics(NETWORK, "node-1")
    metrics.add_transport_stats(TransportStatsCollector(NETWORK, stats))
    perf = str(release / "metaroce-perf")
    config = f"addr=127.0.0.1,stats_dir={STATS_CONTAINER_DIR}"
    server = subprocess.Popen(
        in_container(server_dir, [perf, "server", "--once", "--config", config]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    procs = [server]
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        url = re.search(r"listening on (\S+)", first)
        assert url, first
        client = subprocess.Popen(
            in_container(
                client_dir,
                [perf, "client", url.group(1), "--duration", "4", "--json", "--config", config],
            ),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(client)
        goodputs = []
        deadline = time.monotonic() + 3.5
        while time.monotonic() < deadline:
            text = metrics.render().decode()
            if "metaroce_transport_goodput_bytes_per_second{" in text:
                name = "metaroce_transport_goodput_bytes_per_second"
                goodputs.append(metric(text, name, pod="server", direction="received"))
            time.sleep(0.4)
        out, err = client.communicate(timeout=60)
        assert client.returncode == 0, err
        assert server.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    perf_json = json.loads(out.splitlines()[-1])
    assert max(goodputs, default=0) > 0, f"no goodput seen while it ran: {goodputs}"
    text = metrics.render().decode()
    files = {p.name: json.loads(p.read_text()) for p in server_dir.glob("ep-*.json")}
    assert len(files) == 1 and all(f["closed"] for f in files.values())
    (srv,) = files.values()
    assert metric(text, "metaroce_transport_bytes_received_total", pod="server") == float(
        srv["counters"]["bytes_rcvd"]
    )
    assert srv["counters"]["bytes_rcvd"] >= perf_json["bytes"] > 0
    cli = json.loads(next(client_dir.glob("ep-*.json")).read_text())
    for key, name in (("retransmits", "retransmits"), ("pkts_sent", "packets_sent")):
        got = metric(text, f"metaroce_transport_{name}_total", pod="client")
        assert got == cli["counters"][key]
    assert metric(text, "metaroce_transport_stats_files_refused_total", reason="bad-schema") == 0
    assert metric(text, "metaroce_transport_endpoints", pod="client", state="closed") == 1
    print(f"agent saw goodput (server, received) B/s: {[round(g) for g in goodputs]}")
    # the pods end: their directories go after the grace
    lister.pods = [pod("client", ["eth1-1"])]
    stats.refresh(force=True)
    assert server_dir.exists()  # within the grace period
    stats.refresh(force=True, grace=0)  # what a revert does
    assert not server_dir.exists() and client_dir.exists()
    lister.pods = []
    stats.refresh(force=True, grace=0)
    assert not server_dir.exists() and not client_dir.exists()


# --- the agent loop's wiring --------------------------------------------------------------------


def test_the_agent_serves_stats_only_for_metaroce_networks(tmp_path: Path) -> None:
    def agent(transport: dict[str, Any], qos: dict[str, Any], sockdir: Path) -> Agent:
        cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport=transport, qos=qos)
        (tmp_path / "agent.yaml").write_text(cfg.to_yaml())
        opts = AgentOptions(
            config_path=tmp_path / "agent.yaml", node_name="node-1", report=False,
            metrics_port=None, device_plugin_dir=sockdir,
            pod_resources_socket=str(sockdir / "pr.sock"),
        )  # fmt: skip
        return Agent(opts, host=FixtureHost(tmp_path / "root"))

    with tempfile.TemporaryDirectory(prefix="dpw-") as d:
        mr = agent({"mode": "metaroce"}, {"profile": "lossy"}, Path(d))
        assert mr.transport_stats is not None
        text = mr.metrics.render().decode()
        assert 'metaroce_transport_stats_unowned_allocations{network="rdma-a"} 0.0' in text
        mr.start_plugin()
        try:
            assert mr.plugin.config.stats_dir_for == mr.transport_stats.dirs.create
        finally:
            mr.stop_plugin()
        soft = agent({"mode": "softroce"}, {}, Path(d))
        assert soft.transport_stats is None
        assert "metaroce_transport_" not in soft.metrics.render().decode()
