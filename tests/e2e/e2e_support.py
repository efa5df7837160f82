"""Helpers of the e2e tests: guest programs, rxe setup, counters, packet capture."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from metaroce_harness.guests import BackgroundCommand, CommandResult, Guest

GUEST_PROGRAMS = Path(__file__).parent / "guest"
RXE_DEV = "rxe0"
CONFIGFS = f"/sys/kernel/config/rdma_cm/{RXE_DEV}/ports/1"


def guest_program(guest: Guest, name: str) -> str:
    """The guest path of a program in tests/e2e/guest/."""
    return guest.guest_path(GUEST_PROGRAMS / name)


def run_json(guest: Guest, cmd: str | list[str], timeout: float = 60.0) -> Any:
    """Run a guest program that prints JSON as its last stdout line."""
    result = guest.run(cmd, timeout=timeout, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_rxe(guest: Guest) -> CommandResult:
    """Load rdma_rxe (and rdma_ucm for rdma_cm) and make rxe0 on eth0; idempotent."""
    return guest.run(
        "modprobe -a rdma_rxe rdma_ucm && "
        f"{{ rdma link show {RXE_DEV}/1 >/dev/null 2>&1 || "
        f"rdma link add {RXE_DEV} type rxe netdev eth0; }} && rdma link show {RXE_DEV}/1",
        timeout=60,
        check=True,
    )


def set_default_roce_tos(guest: Guest, tos: int) -> None:
    """Write rdma_cm's configfs default_roce_tos of rxe0 port 1 and read it back."""
    result = guest.run(
        f"mkdir -p /sys/kernel/config/rdma_cm/{RXE_DEV} && "
        f"echo {tos} > {CONFIGFS}/default_roce_tos && cat {CONFIGFS}/default_roce_tos",
        timeout=30,
        check=True,
    )
    assert result.stdout.strip() == str(tos), result.describe()


class Capture:
    """tcpdump of RoCE v2 (udp/4791) on a guest's eth0, summarised by pcap_summary.py."""

    def __init__(self, guest: Guest, path: str = "/tmp/roce.pcap") -> None:
        self.guest = guest
        self.path = path
        # --immediate-mode: no packet may wait in a half-full ring block when the
        # capture is stopped.
        argv = ["tcpdump", "--immediate-mode", "-n", "-U", "-s", "128", "-i", "eth0",
                "-w", path, "udp", "port", "4791"]  # fmt: skip
        self.job = guest.start(argv)
        deadline = time.monotonic() + 30
        while "listening on" not in self.job.output()[1]:
            if self.job.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tcpdump did not start:\n{self.job.kill().describe()}")
            time.sleep(0.1)

    def stop(self) -> dict[str, Any]:
        result = self.job.kill()  # SIGTERM: tcpdump flushes the file and exits
        assert "packets captured" in result.stderr, result.describe()
        summary: dict[str, Any] = run_json(
            self.guest, ["python3", guest_program(self.guest, "pcap_summary.py"), self.path]
        )
        return summary


def wait_for_line(job: BackgroundCommand, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in job.output()[0]:
        if job.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {text!r} from the program:\n{job.kill().describe()}")
        time.sleep(0.1)


def client_server(
    client: Guest,
    server: Guest,
    client_cmd: Sequence[str],
    server_cmd: Sequence[str],
    timeout: float = 120.0,
) -> tuple[CommandResult, CommandResult]:
    """Start a guest program's server side (it prints "listening"), run its client side
    on the other guest, and return both results; an error shows both sides' output."""
    srv = server.start(list(server_cmd))
    try:
        wait_for_line(srv, "listening")
        cli = client.run(list(client_cmd), timeout=timeout)
        if not cli.ok:
            raise AssertionError(
                f"client failed:\n{cli.describe()}\nserver:\n{srv.kill().describe()}"
            )
        srv_result = srv.wait(timeout=60)
    finally:
        if srv.poll() is None:
            srv.kill()
    if not srv_result.ok:
        raise AssertionError(f"server failed:\n{srv_result.describe()}\nclient:\n{cli.describe()}")
    return cli, srv_result
