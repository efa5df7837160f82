"""Real libfabric clients on a multipath fabric: Debian's fi_pingpong between A and B, with
the CPU each process used (getrusage of the child, via wait4) and the host's softirq time.

fi_pingpong (libfabric 1.17, Debian's libfabric-bin) is the only libfabric benchmark Debian
ships: there is no fabtests package (no fi_msg_bw, fi_rdm_tagged_bw). Its -S/-I run is a
ping-pong: one message in flight, each way in turn, so its "MB/sec" (10^6 bytes/s, counting
both directions) is a latency-bound goodput, not a streaming one. Setup goes over the
control link (its control socket to the server's control address); data over the provider,
bound to the `data` interface, i.e. over the ECMP data links.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from fabric import MultipathFabric
from mpirun import provider_env

CLK_TCK = os.sysconf("SC_CLK_TCK")
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}


@dataclass
class ProcUsage:
    user_s: float = 0.0
    sys_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.user_s + self.sys_s


@dataclass
class PingpongResult:
    provider: str
    size: int
    iters: int
    ok: bool
    """Both sides exited 0 before the timeout (and with -c, the data checked)."""
    timed_out: bool
    seconds: float
    """fi_pingpong's own time for the whole run, or the wall time when it stalled."""
    mb_per_s: float
    """fi_pingpong's MB/sec: 10^6 bytes per second, both directions counted."""
    bytes_moved: int
    client: ProcUsage = field(default_factory=ProcUsage)
    server: ProcUsage = field(default_factory=ProcUsage)
    softirq_s: float = 0.0
    """Host-wide softirq CPU time during the run (/proc/stat): the kernel's share of the
    UDP/TCP work (veth, tbf, nftables run there), including any other load on the host."""
    output: str = ""

    @property
    def goodput_mbit(self) -> float:
        return self.mb_per_s * 8

    def cpu_s_per_gb(self) -> dict[str, float]:
        gb = self.bytes_moved / 1e9
        if gb <= 0:
            return {"process": float("nan"), "softirq": float("nan")}
        return {
            "process": (self.client.total_s + self.server.total_s) / gb,
            "softirq": self.softirq_s / gb,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "size": self.size,
            "iters": self.iters,
            "ok": self.ok,
            "timed_out": self.timed_out,
            "seconds": self.seconds,
            "goodput_mbit": self.goodput_mbit,
            "bytes_moved": self.bytes_moved,
            "cpu_client_s": self.client.total_s,
            "cpu_server_s": self.server.total_s,
            "softirq_s": self.softirq_s,
            "cpu_s_per_gb": self.cpu_s_per_gb(),
        }


def softirq_seconds() -> float:
    with open("/proc/stat") as f:
        fields = f.readline().split()
    return int(fields[7]) / CLK_TCK  # cpu user nice system idle iowait irq softirq


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)", text.strip().lower())
    if not m:
        raise ValueError(f"fi_pingpong size {text!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def parse_pingpong(text: str) -> tuple[float, float, int] | None:
    """(seconds, MB/sec, bytes) from fi_pingpong's result line:
    `bytes #sent #ack total time MB/sec usec/xfer Mxfers/sec`, e.g.
    `1m 100 =100 200m 11.27s 18.61 56350.84 0.00`."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[4].endswith("s") and parts[2].startswith("="):
            try:
                return float(parts[4][:-1]), float(parts[5]), parse_size(parts[3])
            except ValueError:
                continue
    return None


def _wait(pid: int, deadline: float) -> tuple[int | None, ProcUsage]:
    """Wait for a child until `deadline` (monotonic); None status when still running."""
    while True:
        wpid, status, ru = os.wait4(pid, os.WNOHANG)
        if wpid == pid:
            code = os.waitstatus_to_exitcode(status)
            return code, ProcUsage(ru.ru_utime, ru.ru_stime)
        if time.monotonic() >= deadline:
            return None, ProcUsage()
        time.sleep(0.05)


def _kill(pid: int) -> ProcUsage:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    _, _status, ru = os.wait4(pid, 0)
    return ProcUsage(ru.ru_utime, ru.ru_stime)


def run_pingpong(
    fab: MultipathFabric,
    provider: str,
    size: int,
    iters: int,
    timeout: float = 60.0,
    check_data: bool = True,
    provider_path: str | None = None,
    port: int = 47592,
    extra_env: dict[str, str] | None = None,
) -> PingpongResult:
    """fi_pingpong server in B, client in A (`-e rdm -m tagged -S size -I iters [-c]`)."""
    env = os.environ | provider_env(provider, provider_path) | (extra_env or {})
    opts = ["-p", provider, "-e", "rdm", "-m", "tagged", "-S", str(size), "-I", str(iters)]
    if check_data:
        opts.append("-c")
    files = {r: tempfile.TemporaryFile("w+") for r in ("server", "client")}  # noqa: SIM115
    irq0 = softirq_seconds()
    start = time.monotonic()
    deadline = start + timeout
    srv = subprocess.Popen(
        fab.exec_argv("b", ["fi_pingpong", *opts, "-B", str(port)]),
        stdout=files["server"], stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    time.sleep(0.3)
    cli = subprocess.Popen(
        fab.exec_argv("a", ["fi_pingpong", *opts, "-P", str(port), fab.ctl_addr("b")]),
        stdout=files["client"], stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    cli_rc, cli_ru = _wait(cli.pid, deadline)
    srv_rc, srv_ru = _wait(srv.pid, max(deadline, time.monotonic() + 5))
    timed_out = cli_rc is None or srv_rc is None
    if cli_rc is None:
        cli_ru = _kill(cli.pid)
    if srv_rc is None:
        srv_ru = _kill(srv.pid)
    cli.returncode, srv.returncode = cli_rc, srv_rc  # reaped by wait4 already
    wall = time.monotonic() - start
    softirq = softirq_seconds() - irq0
    out = {}
    for r, f in files.items():
        f.seek(0)
        out[r] = f.read()
        f.close()
    parsed = parse_pingpong(out["client"])
    ok = not timed_out and cli_rc == 0 and srv_rc == 0 and parsed is not None
    secs, mbs, moved = parsed if parsed else (wall, 0.0, 0)
    return PingpongResult(
        provider=provider, size=size, iters=iters, ok=ok, timed_out=timed_out,
        seconds=secs, mb_per_s=mbs if ok else 0.0, bytes_moved=moved,
        client=cli_ru, server=srv_ru, softirq_s=softirq,
        output=f"--- client (rc {cli_rc})\n{out['client']}"
               f"--- server (rc {srv_rc})\n{out['server']}",
    )  # fmt: skip
