"""The metaroce provider on the namespace fabric with clients we did not write: Debian's
fi_pingpong (data checked) and Open MPI with mpi4py across the namespaces, lossless, at 1%
and 10% random loss, with a link that drops everything mid-transfer, and with random bytes
sprayed at the endpoints' ports."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import clients
import fabric
import mpirun
import pytest
from test_clients import CHECKS, data_bytes

pytestmark = pytest.mark.transport

RELEASE = (
    Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    / "metaroce/transport/target/release"
)


@pytest.fixture(scope="module")
def provider_path() -> str:
    lib = RELEASE / "libmetaroce-fi.so"
    assert lib.is_file(), f"{lib} is missing: run bash hack/build-transport.sh (setup does)"
    return str(RELEASE)


@pytest.mark.parametrize("loss", [0, 100], ids=["lossless", "1pct"])
@pytest.mark.parametrize("size", [4096, 1 << 20], ids=["4KiB", "1MiB"])
def test_fi_pingpong_over_metaroce(
    clean: fabric.MultipathFabric, provider_path: str, size: int, loss: int
) -> None:
    if loss:
        clean.set_impairments([fabric.Impairment("drop", loss)])
    before = clean.counters()
    res = clients.run_pingpong(
        clean, "metaroce", size, iters=50, timeout=120, provider_path=provider_path
    )
    after = clean.counters()
    assert res.ok, res.output
    assert res.bytes_moved == 2 * 50 * size
    moved = data_bytes(after, "b", clean.data_links()) - data_bytes(before, "b", clean.data_links())
    assert moved >= 50 * size, "the payload crossed the data links"
    used = [
        d
        for d in clean.data_links()
        if data_bytes(after, "b", [d]) - data_bytes(before, "b", [d]) > 50 * 1000
    ]
    if size >= 1 << 20:
        assert len(used) >= 3, f"one connection sprays over the links: only {used} carried data"


@pytest.mark.parametrize("loss", [0, 100, 1000], ids=["lossless", "1pct", "10pct"])
def test_mpi_semantics_over_metaroce(
    clean: fabric.MultipathFabric, provider_path: str, loss: int
) -> None:
    if loss:
        clean.set_impairments([fabric.Impairment("drop", loss)])
    res = mpirun.run_mpi(
        clean,
        "metaroce",
        [mpirun.MPI_PYTHON, CHECKS, "semantics"],
        timeout=240,
        provider_path=provider_path,
    )
    assert res.returncode == 0 and "ALL OK" in res.stdout, res.stdout + res.stderr
    for check in (
        "pickled",
        "ANY_SOURCE",
        "Cancel",
        "ranks per namespace [2, 2]",
        "8 MiB",
        "Issend",
    ):
        assert check in res.stdout, f"{check} missing from:\n{res.stdout}"


def test_mpi_allreduce_rows_at_1pct_loss_over_metaroce(
    clean: fabric.MultipathFabric, provider_path: str
) -> None:
    # The allreduce timing mode the loss benchmark uses, data checked, on the arm under test.
    clean.set_impairments([fabric.Impairment("drop", 100)])
    sizes = "1024,65536,1048576,4194304"
    argv = [mpirun.MPI_PYTHON, CHECKS, "allreduce", sizes, "0.5"]
    res = mpirun.run_mpi(clean, "metaroce", argv, timeout=120, provider_path=provider_path)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert [r["size"] for r in rows] == [int(s) for s in sizes.split(",")]
    assert all(r["correct"] and r["iters"] >= 5 and r["p99_s"] >= r["median_s"] for r in rows)


def test_a_link_that_drops_everything_mid_transfer(
    clean: fabric.MultipathFabric, provider_path: str
) -> None:
    def cut() -> None:
        time.sleep(1.0)
        clean.set_impairments([fabric.Impairment("blackhole", link=1)])

    t = threading.Thread(target=cut)
    t.start()
    res = clients.run_pingpong(
        clean, "metaroce", 1 << 20, iters=200, timeout=180, provider_path=provider_path
    )
    t.join()
    assert res.ok, res.output


SPRAYER = """
import os, random, socket, sys, time
dst, lo, hi, rate = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(int(sys.argv[5]))
socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(8)]
sent = 0
t0 = time.monotonic()
try:
    while True:
        # random lengths up to a full 1500-MTU datagram; some open like a real header
        body = bytearray(os.urandom(rng.randint(1, 1472)))
        if rng.random() < 0.5 and len(body) > 2:
            body[0] = 1
        try:
            rng.choice(socks).sendto(body, (dst, rng.randint(lo, hi)))
            sent += 1
        except OSError:
            pass
        time.sleep(max(0.0, t0 + sent / rate - time.monotonic()))
except KeyboardInterrupt:
    print(sent, flush=True)
"""


def test_random_bytes_at_the_ports_corrupt_nothing_and_are_counted(
    clean: fabric.MultipathFabric, provider_path: str, tmp_path: Path
) -> None:
    """Random datagrams at every port of both endpoints' range while fi_pingpong moves
    checked data: the data stays intact, nothing crashes, and the endpoints count the
    datagrams as drops (read from the stats file, `stats_dir=`)."""
    lo, hi = 31000, 31063
    paths = 16
    stats = tmp_path / "stats"
    stats.mkdir()
    env = {"MR_CONFIG": f"ports={lo}-{hi},paths={paths},stats_dir={stats}"}

    def sprayer(src: str, dst: str, seed: int) -> subprocess.Popen[str]:
        # an endpoint binds its paths from the bottom of the range: aim at those
        top = lo + paths - 1
        rate = "2000"
        argv = ["python3", "-c", SPRAYER, clean.data_addr(dst), str(lo), str(top), rate, str(seed)]
        return subprocess.Popen(clean.exec_argv(src, argv), stdout=subprocess.PIPE, text=True)

    sprayers = [sprayer("a", "b", 1), sprayer("b", "a", 2)]
    try:
        res = clients.run_pingpong(
            clean, "metaroce", 1 << 20, iters=300, timeout=180, provider_path=provider_path,
            extra_env=env,
        )  # fmt: skip
    finally:
        for s in sprayers:
            s.send_signal(signal.SIGINT)
        sprayed = [int((s.communicate(timeout=10)[0] or "0").strip() or 0) for s in sprayers]
    assert res.ok, res.output
    assert res.bytes_moved == 2 * 300 * (1 << 20)
    files = sorted(stats.glob("ep-*.json"))
    assert len(files) >= 2, f"one stats file per endpoint: {files}"
    snaps = [json.loads(f.read_text()) for f in files]
    assert all(s["closed"] for s in snaps), "each endpoint wrote its last snapshot at close"
    drop_keys = ("drops_crc", "drops_malformed", "drops_version", "drops_unknown_conn")
    dropped = sum(s["counters"][k] for s in snaps for k in drop_keys)
    print(f"sprayed {sprayed}, counted drops {dropped}")
    # What the sprayers sent before the endpoints bound or after they closed the
    # kernel dropped; the rest reached a socket and is counted.
    assert dropped > 0.6 * sum(sprayed), (sprayed, [s["counters"] for s in snaps])


def test_metaroce_perf_serves_incast_senders_at_once() -> None:
    """One metaroce-perf server, three clients sending into it at once through the incast
    fabric's shaped port (the figures are bench/transport_scenarios.py's): every session
    completes, the server exits after the three, and no sender is starved."""
    perf = str(RELEASE / "metaroce-perf")
    with fabric.IncastFabric(name=fabric.new_name("mrft"), senders=3) as inc:
        cfg = f"addr={inc.addr('r')},ports=30000-30100,rate_mbps={inc.rate_mbit}"
        srv = subprocess.Popen(
            inc.exec_argv("r", [perf, "server", "--sessions", "3", "--config", cfg]),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        assert srv.stdout is not None
        url = srv.stdout.readline().split()[-1]

        def client(s: str) -> subprocess.Popen[str]:
            argv = [perf, "client", url, "--duration", "2", "--json"]
            argv += ["--config", f"addr={inc.addr(s)},ports=31000-31100"]
            return subprocess.Popen(inc.exec_argv(s, argv), stdout=subprocess.PIPE, text=True)

        clients = [client(s) for s in ("s1", "s2", "s3")]
        docs = [json.loads(c.communicate(timeout=60)[0].splitlines()[-1]) for c in clients]
        assert srv.wait(timeout=30) == 0, srv.stdout.read()
    rates = [float(d["goodput_mbit"]) for d in docs]
    assert all(c.returncode == 0 for c in clients)
    assert min(rates) > 0.2 * max(rates), rates
    assert sum(rates) > 0.5 * inc.rate_mbit, rates
