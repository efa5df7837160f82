"""Self-test of an installed MetaRoCE transport directory: real transfers on loopback.

    python -m metaroce_agent.transport.selftest DIR

1. NCCL's plugin: two `nccl-net-check` ranks load `DIR/lib/libnccl-net-metaroce.so` the
   way NCCL does and move 4 MiB each way over the transport on `lo`;
2. the libfabric provider: `metaroce-fi-selftest` loads `DIR/lib/libmetaroce-fi.so`
   through libfabric (FI_PROVIDER_PATH) and runs its checks between two endpoints;
3. `metaroce-perf`: a server and a latency client on 127.0.0.1.

Prints one `ok ...` line per check and exits 0, or prints `FAIL ...` and exits 1. The
agent runs it as the verify of `MetaRoceLibraryStep` (a child process: a crash of the
library under test never takes the agent down).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

TIMEOUT_S = 90
"""Each part's limit. Seen on a 1-vCPU emulated node at load 15: the NCCL part needed
more than 30 s, and a node that is merely slow must still verify (the whole self-test
stays within the agent's `SELFTEST_TIMEOUT_S`)."""


class SelfTestError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MR_", "FI_", "NCCL_"))}
    env.update(extra)
    return env


def _tail(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no output"


def nccl_plugin(root: Path) -> str:
    lib = root / "lib"
    port = _free_port()
    env = _env(LD_LIBRARY_PATH=str(lib), MR_NCCL_IFNAME="=lo", MR_CONFIG="addr=127.0.0.1")
    argv = [str(root / "bin/nccl-net-check"), "--bootstrap", f"127.0.0.1:{port}"]
    argv += ["--ifname", "lo", "--bulk-mib", "1", "--timeout", str(TIMEOUT_S)]
    procs = [
        subprocess.Popen(
            [*argv, "--rank", str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = []
    for rank, proc in enumerate(procs):
        try:
            out, _ = proc.communicate(timeout=TIMEOUT_S + 5)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise SelfTestError(f"NCCL plugin: rank {rank} hung") from None
        if proc.returncode != 0 or f"ALL OK rank {rank}" not in out:
            raise SelfTestError(f"NCCL plugin: rank {rank}: {_tail(out)}")
        outs.append(out)
    rate = re.search(r"([\d.]+) Mbit/s received", outs[0])
    loaded = re.search(r"loaded (ncclNetPlugin_v\d+)", outs[0])
    return (
        f"NCCL plugin {loaded.group(1) if loaded else '?'}: 1 MiB each way on lo "
        f"({rate.group(1) if rate else '?'} Mbit/s)"
    )


def provider(root: Path) -> str:
    env = _env(FI_PROVIDER_PATH=str(root / "lib"), MR_CONFIG="addr=127.0.0.1")
    try:
        res = subprocess.run(
            [str(root / "bin/metaroce-fi-selftest")],
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SelfTestError("libfabric provider: self-test hung") from None
    if res.returncode != 0 or "ALL-OK" not in res.stdout:
        why = _tail(res.stderr + res.stdout)
        if "libfabric.so" in why:
            why += " (install libfabric1 in the agent image)"
        raise SelfTestError(f"libfabric provider: {why}")
    checks = sum(1 for line in res.stdout.splitlines() if line.startswith("ok "))
    return f"libfabric provider: {checks} checks through fi_* on 127.0.0.1"


def perf(root: Path) -> str:
    tool = str(root / "bin/metaroce-perf")
    server = subprocess.Popen(
        [tool, "server", "--once", "--config", "addr=127.0.0.1"],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()
        m = re.search(r"listening on (\S+)", first)
        if not m:
            raise SelfTestError(f"metaroce-perf server: {first.strip() or 'no output'}")
        res = subprocess.run(
            [
                tool,
                "client",
                m.group(1),
                "--mode",
                "lat",
                "--iters",
                "50",
                "--config",
                "addr=127.0.0.1",
            ],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        if res.returncode != 0:
            raise SelfTestError(f"metaroce-perf client: {_tail(res.stderr + res.stdout)}")
        return "metaroce-perf: 50 round trips on 127.0.0.1"
    except subprocess.TimeoutExpired:
        raise SelfTestError("metaroce-perf client hung") from None
    finally:
        server.kill()
        server.wait()


def run(root: Path) -> list[str]:
    return [check(root) for check in (nccl_plugin, provider, perf)]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m metaroce_agent.transport.selftest DIR", file=sys.stderr)
        return 2
    try:
        for line in run(Path(args[0])):
            print(f"ok {line}")
    except (SelfTestError, OSError) as e:
        print(f"FAIL {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
