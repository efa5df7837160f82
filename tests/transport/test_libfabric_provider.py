"""The libfabric provider "metaroce" driven by clients we did not write: Debian's fi_info
and fi_pingpong, and Open MPI (pml cm, mtl ofi) running mpi4py, on this host.

The transport and the provider are built by hack/build-transport.sh (cargo, then
transport/libfabric/build.sh) into the cargo release directory. Nothing is skipped: a
missing tool or library fails the test with what to install or build.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-transport.sh"
SELFTEST = Path("libfabric") / "selftest"
"""transport/libfabric/build.sh puts the self-test there, beside libmetaroce-fi.so."""
MPI_CHECK = Path(__file__).with_name("mpi_provider_check.py")
SYSTEM_PYTHON = "/usr/bin/python3"
"""Debian's python3-mpi4py is installed for the system interpreter, not the .venv."""


def _need(tool: str, package: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} not found: install Debian's {package}")
    return path


def _run(
    cmd: list[str], timeout: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run cmd in its own process group; on timeout the whole group is killed (mpirun's
    ranks included) and the test fails with what was printed."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout} s:\n{out[-4000:]}{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def provider_dir() -> Path:
    """Build the transport and the provider (hack/build-transport.sh: cargo, then
    transport/libfabric/build.sh); return the release directory, FI_PROVIDER_PATH."""
    built = _run(["bash", str(BUILD_SCRIPT)], timeout=1800, cwd=ROOT)
    if built.returncode != 0:
        log = built.stdout[-3000:] + built.stderr[-3000:]
        pytest.fail(f"{BUILD_SCRIPT} failed:\n{log}")
    release = Path(built.stdout.strip().splitlines()[-1])
    for need in (release / "libmetaroce.a", release / "libmetaroce-fi.so", release / SELFTEST):
        if not need.exists():
            pytest.fail(f"{BUILD_SCRIPT} succeeded but {need} is missing")
    return release


def _env(provider: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["FI_PROVIDER_PATH"] = str(provider)
    # Loopback keeps the test independent of the host's interfaces.
    env["MR_CONFIG"] = "addr=127.0.0.1"
    env.update(extra)
    return env


def test_only_fi_prov_ini_is_exported(provider_dir: Path) -> None:
    nm = _run(["nm", "-D", "--defined-only", str(provider_dir / "libmetaroce-fi.so")], timeout=30)
    assert nm.returncode == 0, nm.stderr
    names = {line.split()[-1].split("@")[0] for line in nm.stdout.splitlines() if line.strip()}
    assert names == {"fi_prov_ini"}, f"exported: {sorted(names)}"
    ldd = _run(["ldd", str(provider_dir / "libmetaroce-fi.so")], timeout=30)
    assert "libmetaroce" not in ldd.stdout, (
        f"the transport must be linked in statically:\n{ldd.stdout}"
    )


def test_provider_semantics_in_one_process(provider_dir: Path) -> None:
    """build/selftest: peek/claim/discard, truncation, cancel, cq data, FI_SOURCE,
    directed receives, inject with a completion, selective completion, sread, wait fd."""
    out = _run([str(provider_dir / SELFTEST)], timeout=120, env=_env(provider_dir))
    assert out.returncode == 0, f"selftest failed:\n{out.stdout}{out.stderr}"
    assert "ALL-OK" in out.stdout, out.stdout


def test_fi_info_lists_the_provider(provider_dir: Path) -> None:
    fi_info = _need("fi_info", "libfabric-bin")
    out = _run([fi_info, "-p", "metaroce", "-v"], timeout=60, env=_env(provider_dir))
    assert out.returncode == 0, f"fi_info -p metaroce failed:\n{out.stdout}{out.stderr}"
    text = out.stdout
    assert "prov_name: metaroce" in text
    assert "type: FI_EP_RDM" in text
    for cap in ("FI_MSG", "FI_TAGGED", "FI_DIRECTED_RECV", "FI_SOURCE", "FI_LOCAL_COMM"):
        assert cap in text, f"{cap} not advertised"
    assert "FI_RMA" not in text and "FI_ATOMIC" not in text, (
        "RMA/atomics advertised but not implemented"
    )
    assert "cq_data_size: 8" in text
    assert "threading: FI_THREAD_SAFE" in text
    assert "op_flags: [ FI_TRANSMIT_COMPLETE ]" in text
    # Hints it cannot meet give no entry.
    rma = _run([fi_info, "-p", "metaroce", "-c", "FI_RMA"], timeout=60, env=_env(provider_dir))
    assert rma.returncode != 0 and "provider: metaroce" not in rma.stdout


def _free_tcp_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    want = f":{port:04X} "
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        if any(want in line and line.split()[3] == "0A" for line in lines):
            return True
    return False


@pytest.fixture
def pingpong_port() -> Iterator[int]:
    yield _free_tcp_port()


@pytest.mark.parametrize(
    ("mode", "size", "iterations"),
    [
        # Every size from 0 bytes to 6 MiB, data checked; 100 iterations keep the test
        # within a minute or two per mode on 2 cores.
        ("tagged", "all", 100),
        ("msg", "all", 100),
        # 1000 iterations at the inject limit (fi_tinject) and just above it.
        ("tagged", "4096", 1000),
        ("msg", "4097", 1000),
    ],
)
def test_fi_pingpong_checks_data(
    provider_dir: Path, pingpong_port: int, mode: str, size: str, iterations: int
) -> None:
    pingpong = _need("fi_pingpong", "libfabric-bin")
    args = [pingpong, "-p", "metaroce", "-e", "rdm", "-m", mode, "-c"]
    args += ["-S", size, "-I", str(iterations)]
    env = _env(provider_dir)
    server = subprocess.Popen(
        [*args, "-B", str(pingpong_port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        deadline = time.monotonic() + 30
        while not _listening(pingpong_port):
            assert server.poll() is None, f"fi_pingpong server exited:\n{server.communicate()[0]}"
            assert time.monotonic() < deadline, "fi_pingpong server never listened"
            time.sleep(0.05)
        client = _run([*args, "-P", str(pingpong_port), "127.0.0.1"], timeout=400, env=env)
        server_out, _ = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    assert client.returncode == 0, (
        f"client failed:\n{client.stdout}{client.stderr}\nserver:\n{server_out}"
    )
    assert server.returncode == 0, f"server failed:\n{server_out}"
    rows = [
        line.split()
        for line in client.stdout.splitlines()
        if line.split()[:1] and line.split()[0][0].isdigit()
    ]
    if size == "all":
        assert len(rows) >= 40, f"expected every size in the table:\n{client.stdout}"
        assert rows[-1][0] == "6m", client.stdout
    else:
        assert len(rows) == 1, client.stdout
    # "#sent" == "#ack": every message came back, and -c found no corrupted byte.
    assert all(row[2].startswith("=") for row in rows), client.stdout
    assert "Error" not in client.stdout + server_out


def _mpirun(provider: Path, ranks: int, timeout: float) -> subprocess.CompletedProcess[str]:
    mpirun = _need("mpirun", "openmpi-bin")
    if not Path(SYSTEM_PYTHON).exists():
        pytest.fail(f"{SYSTEM_PYTHON} missing: install Debian's python3-mpi4py")
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        str(ranks),
        "--mca",
        "pml",
        "cm",
        "--mca",
        "mtl",
        "ofi",
        "--mca",
        "mtl_ofi_provider_include",
        "metaroce",
        "-x",
        "FI_PROVIDER_PATH",
        "-x",
        "MR_CONFIG",
        SYSTEM_PYTHON,
        str(MPI_CHECK),
    ]
    return _run(cmd, timeout=timeout, env=_env(provider))


@pytest.mark.parametrize("ranks", [2, 4])
def test_open_mpi_over_the_provider(provider_dir: Path, ranks: int) -> None:
    out = _mpirun(provider_dir, ranks, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, f"mpirun failed ({out.returncode}):\n{text[-6000:]}"
    for r in range(ranks):
        assert f"ALL-OK rank {r}" in out.stdout, f"rank {r} did not finish:\n{text[-6000:]}"
    # pml cm must really have used the OFI MTL over metaroce (not silently ob1/tcp).
    assert "CHECK cancel ok" in out.stdout


def test_open_mpi_selected_metaroce(provider_dir: Path) -> None:
    """With mtl_base_verbose the MTL names the provider it selected."""
    mpirun = _need("mpirun", "openmpi-bin")
    cmd = [
        mpirun,
        "--allow-run-as-root",
        "-np",
        "1",
        "--mca",
        "pml",
        "cm",
        "--mca",
        "mtl",
        "ofi",
        "--mca",
        "mtl_ofi_provider_include",
        "metaroce",
        "--mca",
        "mtl_base_verbose",
        "100",
        "-x",
        "FI_PROVIDER_PATH",
        "-x",
        "MR_CONFIG",
        SYSTEM_PYTHON,
        "-c",
        "from mpi4py import MPI; print('size', MPI.COMM_WORLD.Get_size())",
    ]
    out = _run(cmd, timeout=120, env=_env(provider_dir))
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "mtl:ofi:provider: metaroce" in text, text[-4000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
