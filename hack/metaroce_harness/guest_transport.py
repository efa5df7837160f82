"""metaroce-perf and ib_write_bw between two SoftRoCE guests, under netem and RED.

Shared by ``tests/e2e/test_transport_guests.py`` (a short correctness run) and
``bench/transport_guests.py`` (more runs, medians). Uses only the guest harness's public
API (``Guest.run`` / ``Guest.start``).

The host's ``metaroce-perf`` (built by ``hack/build-transport.sh``) runs unchanged in the
guests: both are Debian 12 with glibc 2.36 and it links only libc and libgcc_s. It
reaches the guests the way the repository does, over the read-only ``/share``: it is
copied into ``.guest-transport/`` of the repository (ignored by git), so no image
rebuild and no extra 9p share (and so no extra boot) is needed.

Impairments go on ``eth0`` (the guests' private L2) as the root qdisc: ``netem`` loss
and delay on both guests (both directions: data and ACKs), or, on the sender's egress,
``htb`` shaping with a ``red ... ecn`` leaf, where the queue occupancy marks CE.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from metaroce_harness.guests import REPO_ROOT, Guest

BUILD_SCRIPT = REPO_ROOT / "hack" / "build-transport.sh"
STAGE_DIR = REPO_ROOT / ".guest-transport"
PERF = "metaroce-perf"
PERF_PORT = 23000
"""The server's first UDP port (the endpoint's path sockets take the ones after it)."""
RXE = "rxe0"
"""The rxe device on eth0: the name tests/e2e/e2e_support.ensure_rxe gives it, so the
e2e session's guests keep one rxe device on eth0 whichever test made it."""
IB_WRITE_BW_FLAGS = "-s 65536 -t 4 -u 20 -F --report_gbits"
"""64 KiB writes, 4 outstanding, a 4.3 s ACK timeout (-u 20): under TCG shorter timeouts
(-u 14 = 67 ms) fire spuriously and go-back-N then retries in storms. Robust for a
lossless run; under 1% loss a 5 s run often completes no write at all (one loss of a
retransmission waits the whole timeout), so rxe's lossy figure is then 0."""
BENCH_RXE_FLAGS = "-s 65536 -t 4 -u 17 -F --report_gbits"
"""The benchmark's flags: a 0.54 s ACK timeout (-u 17) lets go-back-N finish writes in a
10 s run at 1% loss (seen: 0.005 Gb/s against 0.044 lossless, 2026-12-01), and lossless
runs were as fast as with -u 20."""


class TransportStageError(RuntimeError):
    """metaroce-perf could not be built or staged for the guests."""


def release_dir() -> Path:
    """Run ``hack/build-transport.sh`` (seconds when built) and return its release dir."""
    proc = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, cwd=REPO_ROOT
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise TransportStageError(
            f"{BUILD_SCRIPT} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return Path(lines[-1])


def stage_perf(release: Path | None = None) -> Path:
    """Copy metaroce-perf into the repository's ignored ``.guest-transport/`` (the guests
    see it under ``/share``) and return the host path of the copy."""
    src = (release or release_dir()) / PERF
    if not src.is_file():
        raise TransportStageError(f"{src} is missing: run {BUILD_SCRIPT}")
    STAGE_DIR.mkdir(exist_ok=True)
    dst = STAGE_DIR / PERF
    tmp = STAGE_DIR / f".{PERF}.tmp"
    shutil.copy2(src, tmp)
    tmp.replace(dst)  # atomic: a guest never runs a half-copied binary
    return dst


# --- impairments ---------------------------------------------------------------------

NETEM_DELAY_MS = 1.0
"""The delay of both arms of a loss comparison: the lossless arm has it too, so the
ratio isolates the loss."""


def clear_qdisc(guest: Guest, dev: str = "eth0") -> None:
    """Remove the root qdisc of ``dev`` (back to the default); idempotent."""
    guest.run(f"tc qdisc del dev {dev} root 2>/dev/null; true", timeout=30, check=True)


def set_netem(guest: Guest, loss_percent: float, delay_ms: float, dev: str = "eth0") -> str:
    """netem with random loss and a fixed delay as ``dev``'s root qdisc; returns
    ``tc qdisc show``. A 10000-packet limit so netem's own queue never drops."""
    guest.run(
        f"modprobe sch_netem && tc qdisc replace dev {dev} root netem limit 10000 "
        f"delay {delay_ms}ms loss {loss_percent}%",
        timeout=30,
        check=True,
    )
    return guest.run(f"tc qdisc show dev {dev}", timeout=30, check=True).stdout


def set_red_bottleneck(
    guest: Guest, rate_mbit: int, dev: str = "eth0", delay_ms: float = 0.0
) -> str:
    """``dev``'s egress shaped to ``rate_mbit`` by htb with a RED leaf that marks ECN
    (ECT packets get CE once the average queue passes ``min``; non-ECT ones are dropped
    there instead). Thresholds are sized to the rate: min ~2 ms, max ~6 ms of queue.
    With ``delay_ms`` > 0, a netem delay below RED (a longer, more realistic RTT)."""
    bytes_per_ms = rate_mbit * 1000 // 8
    lo = max(3000, 2 * bytes_per_ms)
    hi = max(3 * lo, 6 * bytes_per_ms)
    limit = 4 * hi
    cmds = [
        "modprobe -a sch_htb sch_red sch_netem",
        f"tc qdisc replace dev {dev} root handle 1: htb default 10",
        f"tc class add dev {dev} parent 1: classid 1:10 htb rate {rate_mbit}mbit "
        f"ceil {rate_mbit}mbit burst 15k",
        f"tc qdisc add dev {dev} parent 1:10 handle 10: red limit {limit} min {lo} "
        f"max {hi} avpkt 1500 burst {(2 * lo + hi) // 4500 + 1} probability 0.1 "
        f"bandwidth {rate_mbit}mbit ecn",
    ]
    if delay_ms > 0:
        cmds.append(f"tc qdisc add dev {dev} parent 10: handle 20: netem delay {delay_ms}ms")
    guest.run(" && ".join(cmds), timeout=30, check=True)
    return guest.run(f"tc -s qdisc show dev {dev}", timeout=30, check=True).stdout


def red_marked(guest: Guest, dev: str = "eth0") -> dict[str, int]:
    """RED's counters from ``tc -s qdisc``: packets ECN-marked and dropped early."""
    out = guest.run(f"tc -s qdisc show dev {dev}", timeout=30, check=True).stdout
    red = out[out.find("qdisc red") :] if "qdisc red" in out else ""
    m = re.search(r"marked (\d+) early (\d+)", red)
    return {"marked": int(m.group(1)), "early": int(m.group(2))} if m else {}


def tune_socket_buffers(guest: Guest, size: int = 8 << 20) -> None:
    """Let metaroce-perf's UDP sockets have the buffers it asks for (8 MiB); the
    guest's default cap (208 KiB) drops bursts that a slow TCG receiver leaves queued."""
    guest.run(
        f"sysctl -qw net.core.rmem_max={size} net.core.wmem_max={size}", timeout=30, check=True
    )


@contextlib.contextmanager
def socket_buffers(guests: Iterable[Guest], size: int = 8 << 20) -> Iterator[None]:
    """``tune_socket_buffers`` on each guest for the block, the previous caps restored
    after. net.core.{r,w}mem_max are not per network namespace: raised on the node, they
    let pods' sockets have the buffers the library asks for too."""
    saved: list[tuple[Guest, str]] = []
    try:
        for g in guests:
            out = g.run("sysctl -n net.core.rmem_max net.core.wmem_max", timeout=30, check=True)
            rmem, wmem = out.stdout.split()
            saved.append((g, f"net.core.rmem_max={rmem} net.core.wmem_max={wmem}"))
            tune_socket_buffers(g, size)
        yield
    finally:
        for g, previous in saved:
            g.run(f"sysctl -qw {previous}", timeout=30)


# --- metaroce-perf -------------------------------------------------------------------


@dataclass(frozen=True)
class PerfResult:
    """One metaroce-perf client run (its ``--json`` line) and the server's output."""

    report: dict[str, Any]
    server_output: str

    @property
    def gbps(self) -> float:
        return float(self.report["goodput_gbps"])


def metaroce_perf(
    client: Guest,
    server: Guest,
    perf_host_path: Path,
    seconds: float,
    size: int = 1 << 20,
    window: int = 16,
    config: str = "",
) -> PerfResult:
    """metaroce-perf bandwidth from ``client`` to ``server`` over eth0 (one run; the
    server serves it once and exits). Raises AssertionError with both sides' output on
    any failure."""
    perf = server.guest_path(perf_host_path)
    extra = f",{config}" if config else ""
    srv = server.start(
        f"exec timeout {seconds + 120:.0f} {perf} server --once "
        f"--config addr={server.ip},ports={PERF_PORT}-{PERF_PORT + 63}{extra}"
    )
    try:
        deadline = time.monotonic() + 60
        while (m := re.search(r"listening on (\S+)", srv.output()[0])) is None:
            if srv.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"metaroce-perf server did not start:\n{srv.kill().describe()}"
                )
            time.sleep(0.2)
        r = client.run(
            f"timeout {seconds + 90:.0f} {perf} client {m.group(1)} --json --duration {seconds} "
            f"--size {size} --window {window} --config addr={client.ip}{extra}",
            timeout=seconds + 120,
        )
        done = srv.wait(60)
    except BaseException:
        srv.kill()
        raise
    assert r.ok and done.ok, f"metaroce-perf failed:\n{r.describe()}\n{done.describe()}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return PerfResult(report=report, server_output=done.stdout + done.stderr)


# --- ib_write_bw over rxe ------------------------------------------------------------


def hw_counters(guest: Guest, device: str = RXE) -> dict[str, int]:
    """rxe's hw_counters of port 1 of ``device`` (sent_pkts, completer_retry_err, ...)."""
    out = guest.run(
        f"cd /sys/class/infiniband/{device}/ports/1/hw_counters && grep . *",
        timeout=30,
        check=True,
    ).stdout
    counters = {}
    for line in out.splitlines():
        name, _, value = line.partition(":")
        counters[name] = int(value)
    return counters


def ensure_rxe(guest: Guest) -> None:
    """rdma_rxe loaded and ``rxe0`` on eth0 (the e2e helpers' name); idempotent."""
    guest.run(
        f"modprobe -a rdma_rxe rdma_ucm && {{ rdma link show {RXE}/1 >/dev/null 2>&1 || "
        f"rdma link add {RXE} type rxe netdev eth0; }}",
        timeout=60,
        check=True,
    )


def ib_write_bw(
    client: Guest,
    server: Guest,
    seconds: int,
    attempts: int = 3,
    flags: str = IB_WRITE_BW_FLAGS,
) -> float:
    """ib_write_bw (RC over rxe) from ``client`` to ``server`` for ``seconds``: the
    client's average Gb/s. A run that reports no bandwidth (RC's retry count exceeded,
    which go-back-N reaches under loss) is repeated, ``attempts`` runs in all; then
    AssertionError with the output."""
    opts = f"-d {RXE} -x 1 -D {seconds} {flags}"
    out = ""
    for _ in range(attempts):
        srv = server.start(f"exec timeout {seconds + 90} ib_write_bw {opts}")
        try:
            for _ in range(10):  # the server listens only once set up (slow under TCG)
                time.sleep(2)
                r = client.run(
                    f"timeout {seconds + 60} ib_write_bw {opts} {server.ip}", timeout=seconds + 90
                )
                out = r.stdout + r.stderr
                if r.ok or "Couldn't connect" not in out:
                    break
        finally:
            if srv.poll() is None:
                srv.kill()
        bw = perftest_average_gbps(out)
        if r.ok and bw > 0:
            return bw
    raise AssertionError(f"ib_write_bw gave no bandwidth in {attempts} runs:\n{out[-3000:]}")


def perftest_average_gbps(out: str) -> float:
    """BW average of perftest's last result row (#bytes #iterations BW-peak BW-average
    MsgRate), 0 when there is none."""
    rows = [ln.split() for ln in out.splitlines() if re.match(r"\s*\d+\s+\d+\s+[\d.]+", ln)]
    return float(rows[-1][3]) if rows else 0.0


def paired_ratios(runs: Sequence[float | None], lossless: Sequence[float | None]) -> list[float]:
    """Each run over the lossless run of the same round (the emulated guests' speed drifts
    between rounds, and a pair shares most of it); rounds where either failed (None), or
    the lossless run moved nothing, are left out."""
    return [x / b for x, b in zip(runs, lossless, strict=False) if x is not None and b]


def load_average() -> str:
    """The host's 1/5/15-minute load average (TCG guests share the host's cores)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])
