"""NCCL's net plugin libnccl-net-metaroce.so (transport/nccl/) under its conformance harness.

NCCL cannot start without a GPU, so transport/nccl/harness.c (nccl-net-check) replays
NCCL's call contract between two processes: it dlopens the plugin by the
NCCL_NET_PLUGIN naming rule, calls one ncclNetPlugin_v<N> through that version's own
struct, and checks non-blocking connect/accept, host-only registration, 32 requests in
flight, grouped receives with tags, receives larger than their sends, sends that arrive
before their receives, several comms on one device, two threads at once, iflush, the
closes, and a bulk transfer in both directions with every byte checked. Here: every
version on loopback, and v12 and v6 across the two namespaces of the multipath fabric,
lossless and at 1% random loss; a recorded call trace replayed; the same under ASan/UBSan.
hack/build-transport.sh builds the plugin and the harness.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import fabric
import pytest
from test_clients import data_bytes

pytestmark = pytest.mark.transport

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-transport.sh"
PLUGIN = "libnccl-net-metaroce.so"
HARNESS = Path("nccl") / "nccl-net-check"
"""transport/nccl/build.sh puts the harness there, beside the plugin."""
VERSIONS = list(range(6, 13))
EXPORTS = {f"ncclNetPlugin_v{v}" for v in VERSIONS}
LOSS_RATIO_FLOOR = 0.85
"""Issue 14: goodput at 1% loss at least 0.85 of lossless."""


@dataclass
class PairResult:
    returncodes: tuple[int | None, int | None]
    outputs: tuple[str, str]
    results: list[dict[str, object]]

    @property
    def ok(self) -> bool:
        return self.returncodes == (0, 0) and all(
            f"ALL OK rank {r}" in out for r, out in enumerate(self.outputs)
        )

    def log(self) -> str:
        return "".join(
            f"--- rank {r} (rc {rc})\n{out[-5000:]}"
            for r, (rc, out) in enumerate(zip(self.returncodes, self.outputs, strict=True))
        )

    def goodput_mbps(self) -> float:
        """The received goodput (both ways at once: the slower direction's)."""
        rates = [float(str(r["goodput_mbps"])) for r in self.results if "goodput_mbps" in r]
        assert rates, self.log()
        return min(rates)


@pytest.fixture(scope="module")
def release() -> Path:
    """Build the transport, the provider and the plugin (hack/build-transport.sh); the
    release directory holds the plugin and nccl/nccl-net-check."""
    built = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
    if built.returncode != 0:
        pytest.fail(f"{BUILD_SCRIPT} failed:\n{built.stdout[-3000:]}{built.stderr[-3000:]}")
    rel = Path(built.stdout.strip().splitlines()[-1])
    for need in (rel / PLUGIN, rel / HARNESS):
        if not need.exists():
            pytest.fail(f"{BUILD_SCRIPT} succeeded but {need} is missing")
    return rel


def _loopback() -> str:
    """A free TCP port on loopback for the bootstrap (other jobs on this host use
    loopback too; the fabric's namespaces are private)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _env(rel: Path, ifname: str) -> dict[str, str]:
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(rel)  # NCCL dlopens libnccl-net-<name>.so by name
    env["NCCL_NET_PLUGIN"] = "metaroce"
    env["MR_NCCL_IFNAME"] = f"={ifname}"
    env.pop("MR_CONFIG", None)
    return env


def _wait(procs: Sequence[subprocess.Popen[str]], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes.append(None)
    return codes


def run_pair(
    rel: Path,
    version: int,
    bootstrap: str,
    ifname: str,
    wrap: Sequence[Sequence[str]] = ((), ()),
    bulk_mib: int = 32,
    extra: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    timeout: float = 150,
) -> PairResult:
    """Rank 0 (it listens on the bootstrap address) and rank 1, each prefixed by its
    wrap (e.g. `ip netns exec NS`); both run to the end or are killed at timeout."""
    env = _env(rel, ifname) | (extra_env or {})
    argv = [
        str(rel / HARNESS), "--version", str(version), "--bootstrap", bootstrap,
        "--ifname", ifname, "--bulk-mib", str(bulk_mib), "--timeout", str(int(timeout) - 10),
        *extra,
    ]  # fmt: skip
    return launch([[*wrap[r], *argv, "--rank", str(r)] for r in (0, 1)], env, timeout)


def launch(cmds: Sequence[Sequence[str]], env: dict[str, str], timeout: float) -> PairResult:
    """Rank 0's command, then (0.2 s later, once it listens) rank 1's."""
    files = [tempfile.TemporaryFile("w+") for _ in range(2)]  # noqa: SIM115
    procs = []
    for r in (0, 1):
        procs.append(
            subprocess.Popen(
                list(cmds[r]),
                stdout=files[r],
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,
            )
        )
        if r == 0:
            time.sleep(0.2)
    codes = _wait(procs, timeout)
    outs = []
    for f in files:
        f.seek(0)
        outs.append(f.read())
        f.close()
    results = [
        json.loads(line.removeprefix("RESULT "))
        for out in outs
        for line in out.splitlines()
        if line.startswith("RESULT ")
    ]
    return PairResult((codes[0], codes[1]), (outs[0], outs[1]), results)


def test_plugin_exports_the_seven_versions_and_needs_only_libc(release: Path) -> None:
    lib = release / PLUGIN
    nm = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True)
    assert nm.returncode == 0, nm.stderr
    names = {line.split()[-1].split("@")[0] for line in nm.stdout.splitlines() if line.strip()}
    assert names == EXPORTS, f"exported: {sorted(names)}"
    dyn = subprocess.run(["objdump", "-p", str(lib)], capture_output=True, text=True, check=True)
    needed = re.findall(r"NEEDED\s+(\S+)", dyn.stdout)
    assert not [n for n in needed if "stdc++" in n or "fabric" in n or "metaroce" in n], needed
    syms = subprocess.run(["objdump", "-T", str(lib)], capture_output=True, text=True, check=True)
    found = re.findall(r"GLIBC_([0-9.]+)", syms.stdout)
    highest = max(tuple(int(x) for x in v.split(".")) for v in found)
    print(f"{PLUGIN}: NEEDED {needed}; highest GLIBC_{'.'.join(map(str, highest))}")
    # Built on this host's glibc; the 2.28 floor of issue 14 item 5 needs an older sysroot.
    assert highest <= (2, 34), f"needs GLIBC_{highest}: more than this host's pthread move"


@pytest.mark.parametrize("version", VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def test_conformance_on_loopback(release: Path, version: int) -> None:
    res = run_pair(release, version, _loopback(), "lo", bulk_mib=16)
    assert res.ok, res.log()
    for out in res.outputs:
        for step in ("connect polled", "the 33rd refused", "grouped receives", "reports 12345",
                     "before their receives were posted", "no message crossed comms",
                     "threads at once", "closeSend"):  # fmt: skip
            assert step in out, f"{step!r} missing:\n{out}"
    props = [r for r in res.results if "speed" in r]
    assert props and all(r["name"] == "lo" and r["ptrSupport"] == 1 for r in props), props


def test_no_device_fails_loudly(release: Path) -> None:
    env = _env(release, "nosuchdev0")
    out = subprocess.run(
        [str(release / HARNESS), "--rank", "0", "--bootstrap", _loopback(), "--timeout", "20"],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert out.returncode != 0
    assert "devices: 0" in out.stdout and "MR_NCCL_IFNAME" in out.stderr, out.stdout + out.stderr


def _on_fabric(
    fab: fabric.MultipathFabric,
    rel: Path,
    version: int,
    port: int,
    bulk_mib: int = 64,
    extra: Sequence[str] = (),
) -> PairResult:
    wrap = (fab.exec_argv("b", []), fab.exec_argv("a", []))
    addr = f"{fab.ctl_addr('b')}:{port}"
    return run_pair(rel, version, addr, "data", wrap=wrap, bulk_mib=bulk_mib, extra=extra)


@pytest.mark.parametrize("version", [12, 6], ids=["v12", "v6"])
@pytest.mark.parametrize("loss", [0, 100], ids=["lossless", "1pct"])
def test_conformance_across_the_fabric(
    clean: fabric.MultipathFabric, release: Path, version: int, loss: int
) -> None:
    if loss:
        clean.set_impairments([fabric.Impairment("drop", loss)])
    before = clean.counters()
    res = _on_fabric(clean, release, version, 5600 + version + loss)
    after = clean.counters()
    assert res.ok, res.log()
    bulk = 64 << 20
    links = clean.data_links()
    for role in ("a", "b"):
        moved = data_bytes(after, role, links) - data_bytes(before, role, links)
        assert moved >= bulk, f"only {moved} bytes reached {role} over the data links"
    if loss:
        drops = [f"drop_{d}" for d in links]
        dropped = sum(
            int(after[r]["nft"][k]["packets"]) - int(before[r]["nft"][k]["packets"])
            for r in ("a", "b")
            for k in drops
        )
        assert dropped > 0, "the 1% impairment dropped nothing"


def test_goodput_at_1pct_loss_against_lossless(
    clean: fabric.MultipathFabric, release: Path
) -> None:
    """7 interleaved runs each (lossless, 1%, ...) so host load hits both alike, one way
    (B to A: two busy-polling processes on this 2-core host make both ways at once
    CPU-bound, and the ratio noise); the medians' ratio must hold issue 14's 0.85."""
    rates: dict[int, list[float]] = {0: [], 100: []}
    for i in range(7):
        for loss in (0, 100):
            clean.set_impairments([fabric.Impairment("drop", loss)] if loss else [])
            port = 5700 + 2 * i + (loss > 0)
            res = _on_fabric(clean, release, 12, port, bulk_mib=96, extra=["--one-way"])
            assert res.ok, res.log()
            rates[loss].append(res.goodput_mbps())
    lossless, lossy = statistics.median(rates[0]), statistics.median(rates[100])
    load = os.getloadavg()
    print(
        f"NCCL harness goodput (one way, Mbit/s): lossless {rates[0]} 1% {rates[100]};"
        f" ratio {lossy / lossless:.2f}; load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}"
    )
    assert lossy >= LOSS_RATIO_FLOOR * lossless, (lossless, lossy, rates)


TRACE_ORDER = [
    r" init v12$",
    r" devices -> 1$",
    r" getProperties dev=0 -> name=lo ",
    r" listen dev=0 -> listenComm=",
    r" connect dev=0 listen_id=\d+ -> NULL \(HELLO sent",
    r" regMr comm=\S+ data=\S+ size=\d+ type=1 -> mhandle=",
    r" regMr comm=\S+ data=\S+ size=4096 type=2 -> refused",
    r" isend sendComm=\S+ data=\S+ size=16 tag=0 mhandle=\S+ -> request=\(nil\)",
    r" irecv recvComm=\S+ n=8 sizes=\[131072(,131072){7}\] tags=\[100,101,(\d+,){5}107\]",
    r" test request=\S+ \(irecv\) -> done sizes=\[12345\] rc=0",
    r" iflush recvComm=\S+ n=1 -> request=NULL",
    r" deregMr comm=",
    r" closeSend comm=",
    r" closeRecv comm=",
    r" closeListen comm=",
    r" finalize$",
]


def test_trace_records_nccls_calls(release: Path, tmp_path: Path) -> None:
    """MR_NCCL_TRACE=PREFIX writes every call (the logging shim for recording what a real
    NCCL does on a GPU machine) to PREFIX.<pid>, one line each, in call order."""
    trace_env = {"MR_NCCL_TRACE": str(tmp_path / "trace")}
    res = run_pair(release, 12, _loopback(), "lo", bulk_mib=4, extra_env=trace_env)
    assert res.ok, res.log()
    traces = sorted(tmp_path.glob("trace.*"))
    assert len(traces) == 2, traces
    for trace in traces:
        lines = trace.read_text().splitlines()
        at = 0
        for want in TRACE_ORDER:
            hit = next((i for i in range(at, len(lines)) if re.search(want, lines[i])), None)
            assert hit is not None, f"{trace}: no {want!r} after line {at}:\n" + "\n".join(
                lines[at : at + 20]
            )
            at = hit
        accepts = [ln for ln in lines if " accept listenComm=" in ln]
        connects = [ln for ln in lines if re.search(r" connect .* -> sendComm=", ln)]
        assert len(accepts) == len(connects) == 7, (accepts, connects)  # 1 + 4 + 2 threads


def _record(release: Path, tmp_path: Path, version: int) -> list[Path]:
    """Run the harness on loopback with MR_NCCL_TRACE; the traces of rank 0 and rank 1."""
    trace_env = {"MR_NCCL_TRACE": str(tmp_path / "trace")}
    res = run_pair(release, version, _loopback(), "lo", bulk_mib=8, extra_env=trace_env)
    assert res.ok, res.log()
    pids = [re.search(r"\(pid (\d+)\)", out) for out in res.outputs]
    assert all(pids), res.log()
    return [tmp_path / f"trace.{m.group(1)}" for m in pids if m]


@pytest.mark.parametrize("version", [12, 6], ids=["v12", "v6"])
def test_replay_of_a_recorded_trace_across_the_fabric_at_1pct(
    clean: fabric.MultipathFabric, release: Path, tmp_path: Path, version: int
) -> None:
    """--replay: each rank makes the recorded calls again, in order, with its own objects,
    and test must report the recorded sizes. A trace recorded from a real NCCL on a GPU
    machine (MR_NCCL_TRACE) replays the same way; here the harness's own is recorded."""
    traces = _record(release, tmp_path, version)
    clean.set_impairments([fabric.Impairment("drop", 100)])
    wrap = (clean.exec_argv("b", []), clean.exec_argv("a", []))
    addr = f"{clean.ctl_addr('b')}:{5540 + version}"
    cmds = [
        [*wrap[r], str(release / HARNESS), "--rank", str(r), "--bootstrap", addr,
         "--ifname", "data", "--replay", str(traces[r]), "--timeout", "140"]
        for r in (0, 1)
    ]  # fmt: skip
    res = launch(cmds, _env(release, "data"), 150)
    assert res.returncodes == (0, 0), res.log()
    for r, out in enumerate(res.outputs):
        assert f"ALL OK rank {r} v{version} replay" in out, res.log()
        assert "sizes as recorded" in out, res.log()


def test_under_asan_and_ubsan(release: Path, tmp_path: Path) -> None:
    """The plugin's C and the harness rebuilt with AddressSanitizer and UBSan (make
    sanitize; UBSan aborts on its first report), v12 and v6 and a replay on loopback.
    Found once: NCCL's handle buffer has no alignment promise (it is now copied)."""
    san = release / "nccl" / "sanitize"
    built = subprocess.run(
        ["make", "-s", "-C", str(ROOT / "transport" / "nccl"), "sanitize",
         f"MR_LIB={release / 'libmetaroce.a'}", f"OUT={release / 'nccl'}"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr
    env = _env(san, "lo") | {
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1",
    }
    harness = str(san / "nccl-net-check")
    traces = _record(release, tmp_path, 12)
    runs = {
        "v12": [["--version", "12", "--bulk-mib", "8"]] * 2,
        "v6": [["--version", "6", "--bulk-mib", "8"]] * 2,
        "replay": [["--replay", str(t)] for t in traces],
    }
    for name, args in runs.items():
        addr = _loopback()
        cmds = [[harness, "--rank", str(r), "--bootstrap", addr,
                 "--ifname", "lo", "--timeout", "200", *args[r]] for r in (0, 1)]  # fmt: skip
        res = launch(cmds, env, 240)
        assert res.ok, f"{name}:\n{res.log()}"
        assert "runtime error" not in "".join(res.outputs), f"{name}:\n{res.log()}"
