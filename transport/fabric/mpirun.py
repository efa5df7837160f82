#!/usr/bin/env python3
"""Run Open MPI jobs across a multipath fabric's namespaces over a chosen libfabric provider.

mpirun runs inside namespace A; ranks are placed by address: the control addresses name the
hosts, and the rsh agent `netns-rsh` starts each remote orted inside the namespace that owns
the address (`ip netns exec`). Open MPI's own traffic (OOB, PMIx, the tcp BTL) stays on the
control link; MPI messages go through `--mca pml cm --mca mtl ofi` and the provider, bound to
the `data` interface (FI_TCP_IFACE/FI_UDP_IFACE), i.e. over the 4 ECMP data links.

    mpirun.py --fabric NAME --provider 'tcp;ofi_rxm' [--ranks-per-ns 2] [--timeout 120]
              [--provider-path DIR] [--env K=V ...] -- /usr/bin/python3 prog.py ARGS

Providers: 'tcp;ofi_rxm', 'udp;ofi_rxd' (Debian's libfabric 1.17), 'metaroce' (a
libmetaroce-fi.so in --provider-path, passed as FI_PROVIDER_PATH). Open MPI's default
mtl_ofi_provider_exclude skips names starting with tcp/udp; setting the include list
replaces it (setting both is refused by Open MPI as mutually exclusive).
Python 3.11 standard library only; the MPI programs run with Debian's /usr/bin/python3
(mpi4py from python3-mpi4py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contextlib

from fabric import MultipathFabric, attach

HERE = Path(__file__).resolve().parent
RSH_AGENT = HERE / "netns-rsh"
MPI_PYTHON = "/usr/bin/python3"
"""Debian's python3: python3-mpi4py is built against Debian's Open MPI."""
KNOWN_PROVIDERS = ("tcp;ofi_rxm", "udp;ofi_rxd", "metaroce")


@dataclass
class MpiResult:
    argv: list[str]
    returncode: int | None
    """None: killed at the timeout (a stalled job)."""
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def provider_env(provider: str, provider_path: str | None) -> dict[str, str]:
    """The FI_* variables for ranks: the data interface, and where `metaroce` lives."""
    env = {"FI_TCP_IFACE": "data", "FI_UDP_IFACE": "data"}
    if provider == "metaroce" or provider_path:
        if not provider_path:
            raise ValueError(
                "provider=metaroce needs provider_path: the folder with libmetaroce-fi.so"
            )
        lib = Path(provider_path) / "libmetaroce-fi.so"
        if not lib.is_file():
            raise ValueError(f"provider_path={provider_path!r}: {lib} does not exist (build it)")
        env["FI_PROVIDER_PATH"] = str(Path(provider_path).resolve())
        env["FI_METAROCE_IFACE"] = "data"  # bind the data address, not the control link's
    return env


def mpirun_argv(
    fab: MultipathFabric,
    provider: str,
    ranks_per_ns: int,
    program: Sequence[str],
    env: dict[str, str],
) -> list[str]:
    """The whole command line (run from the host namespace: it enters A itself)."""
    if provider not in KNOWN_PROVIDERS:
        raise ValueError(f"provider={provider!r}: one of {', '.join(KNOWN_PROVIDERS)}")
    if not 1 <= ranks_per_ns <= 8:
        raise ValueError(f"ranks_per_ns={ranks_per_ns}: 1..8 (this host has 2 cores)")
    hosts = ",".join(f"{fab.ctl_addr(r)}:{ranks_per_ns}" for r in fab.roles())
    argv = [
        *fab.exec_argv("a", ["mpirun"]),
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to", "none",
        "-np", str(ranks_per_ns * len(fab.roles())),
        "--host", hosts,
        "--mca", "plm_rsh_agent", str(RSH_AGENT),
        "--mca", "plm_rsh_no_tree_spawn", "1",
        "--mca", "routed", "direct",
        "--mca", "oob_tcp_if_include", "ctl",
        "--mca", "btl_tcp_if_include", "ctl",
        "--mca", "pml", "cm",
        "--mca", "mtl", "ofi",
        "--mca", "mtl_ofi_provider_include", provider,
    ]  # fmt: skip
    for key, val in sorted(env.items()):
        argv += ["-x", f"{key}={val}"]
    return [*argv, *program]


def run_mpi(
    fab: MultipathFabric,
    provider: str,
    program: Sequence[str],
    ranks_per_ns: int = 2,
    timeout: float = 120.0,
    provider_path: str | None = None,
    extra_env: dict[str, str] | None = None,
    idle_timeout: float | None = None,
) -> MpiResult:
    """Run one job; a job still running at `timeout`, or silent on stdout for
    `idle_timeout` seconds, is killed (its namespaces' processes too) and reported as timed
    out, with the output it had printed (programs print a line per finished step)."""
    env = provider_env(provider, provider_path) | (extra_env or {})
    argv = mpirun_argv(fab, provider, ranks_per_ns, program, env)
    hosts = ",".join(f"{fab.ctl_addr(r)}={fab.ns(r)}" for r in fab.roles())
    proc_env = os.environ | {"METAROCE_NETNS_HOSTS": hosts}
    start = time.monotonic()
    lines: list[str] = []
    last = [start]
    with tempfile.TemporaryFile("w+") as errf:
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errf, text=True, env=proc_env)

        def pump() -> None:
            assert p.stdout is not None
            for line in p.stdout:
                lines.append(line)
                last[0] = time.monotonic()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        rc: int | None = None
        while True:
            try:
                rc = p.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if now - start > timeout or (idle_timeout and now - last[0] > idle_timeout):
                    p.kill()
                    kill_job(fab)
                    p.wait()
                    rc = None
                    break
        reader.join(timeout=5)
        errf.seek(0)
        err = errf.read()
    return MpiResult(argv, rc, "".join(lines), err, time.monotonic() - start)


def kill_job(fab: MultipathFabric) -> None:
    """SIGKILL the orted and rank processes of a job: they live in the fabric's namespaces,
    and orted may still be starting ranks, so sweep until none is left."""
    for _ in range(50):
        pids = [
            pid
            for r in fab.roles()
            for pid in subprocess.run(
                ["ip", "netns", "pids", fab.ns(r)], capture_output=True, text=True, check=False
            ).stdout.split()
        ]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), 9)
        time.sleep(0.1)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fabric", required=True, help="name of a multipath fabric (fabric.py up)")
    ap.add_argument("--provider", required=True, choices=KNOWN_PROVIDERS)
    ap.add_argument("--ranks-per-ns", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--provider-path", help="folder with libmetaroce-fi.so")
    ap.add_argument("--env", action="append", default=[], metavar="K=V")
    ap.add_argument("program", nargs="+")
    args = ap.parse_args(argv)
    fab = attach(args.fabric)
    if not isinstance(fab, MultipathFabric):
        raise SystemExit(f"--fabric {args.fabric}: an incast fabric; MPI runs on multipath")
    extra = dict(kv.split("=", 1) for kv in args.env)
    res = run_mpi(
        fab, args.provider, args.program, args.ranks_per_ns, args.timeout,
        args.provider_path, extra,
    )  # fmt: skip
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.timed_out:
        print(f"mpirun.py: killed after {args.timeout:.0f} s (stalled)", file=sys.stderr)
        return 124
    return res.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
