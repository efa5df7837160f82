"""The shipped files in another userland than the build host's (issue 14 item 5): a
debootstrapped Debian root (hack/build-userland.sh, cached as a tarball) stands in for a
training image with its own glibc and libfabric. Each suite's root is unpacked into the
test's temporary directory, the files are laid out as a pod sees them
(`CONTAINER_DIR`/lib and /bin, like hack/stage-transport.sh), and each check runs in
the root (chroot, as root, /proc and /dev of a private mount namespace, the host's
network namespace: loopback):

- every file's libraries and GLIBC_ versions resolve there (the root's own ldd);
- NCCL's plugin is dlopened by nccl-net-check and moves data between two ranks;
- libfabric lists the provider with the `FI_PROVIDER_PATH` the agent's `Allocate` answer
  sets (`metaroce_api.metaroce_env.allocation_env`), and the image's own providers stay
  listed (FI_PROVIDER_PATH replaces libfabric's default directory);
- the provider's self-test (libfabric's public API, two endpoints on loopback).

Suites: bullseye (Debian 11: glibc 2.31, libfabric 1.11) and trixie (Debian 13: glibc
2.41, libfabric 2.1). The provider is built twice: against Debian 12's libfabric-dev
(1.17, fi_info written as fi_dupinfo@FABRIC_1.3) and against trixie's (2.1, FABRIC_1.8).
Each registers only in a core whose fi_info layout it writes (transport/libfabric/prov.c):
bullseye takes the first (its libfabric cannot load the second), trixie the second (the
first steps aside with a warning), so `fi_info -p metaroce` lists it in both, also for
callers that ask for API 2.1. Any failure names the root's libfabric and what it logged.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from metaroce_api import QosSpec, TransportSpec
from metaroce_api.metaroce_env import CONTAINER_DIR, allocation_env

pytestmark = pytest.mark.transport

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-transport.sh"
USERLAND_SCRIPT = ROOT / "hack" / "build-userland.sh"
FABRIC_H = Path("/usr/include/rdma/fabric.h")
"""The libfabric-dev headers the provider is built against (its fi_version)."""
SUITES = ("bullseye", "trixie")
LAYOUT = {
    "libmetaroce-fi.so": "lib/libmetaroce-fi.so",
    "libmetaroce-v2-fi.so": "lib/libmetaroce-v2-fi.so",
    "libnccl-net-metaroce.so": "lib/libnccl-net-metaroce.so",
    "metaroce-perf": "bin/metaroce-perf",
    "nccl/nccl-net-check": "bin/nccl-net-check",
    "libfabric/selftest": "bin/metaroce-fi-selftest",
}
"""Release file -> its place under CONTAINER_DIR (hack/stage-transport.sh's layout)."""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Userland:
    suite: str
    root: Path
    info: str
    """hack/build-userland.sh's record: suite, Release date, libc6 and libfabric1."""

    def run(
        self, argv: list[str], env: dict[str, str] | None = None, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv), env=self.env(env), capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def command(self, argv: list[str]) -> list[str]:
        """argv in the root: a private mount namespace (gone with the process) for its
        /proc and /dev, then chroot."""
        mounts = 'set -e; mount -t proc proc "$0/proc"; mount --rbind /dev "$0/dev"; '
        mounts += 'exec chroot "$0" "$@"'
        return ["unshare", "--mount", "--propagation", "private", "--fork",
                "sh", "-c", mounts, str(self.root), *argv]  # fmt: skip

    @staticmethod
    def env(extra: dict[str, str] | None) -> dict[str, str]:
        return {"PATH": PATH, "HOME": "/root", "LANG": "C"} | (extra or {})


def _build(cmd: list[str], timeout: float) -> str:
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert built.returncode == 0, f"{cmd} failed:\n{built.stderr[-3000:]}"
    return built.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def release() -> Path:
    return Path(_build(["bash", str(BUILD_SCRIPT)], 1800))


@pytest.fixture(scope="module", params=SUITES)
def userland(
    request: pytest.FixtureRequest, release: Path, tmp_path_factory: pytest.TempPathFactory
) -> Userland:
    suite: str = request.param
    for tool in ("debootstrap", "zstd", "unshare", "chroot"):
        assert shutil.which(tool), f"{tool} not found: apt-get install debootstrap zstd"
    tarball = Path(_build(["bash", str(USERLAND_SCRIPT), suite], 900))
    root = tmp_path_factory.mktemp(suite) / "root"
    root.mkdir()
    subprocess.run(["tar", "-C", str(root), "-I", "zstd", "-xf", str(tarball)], check=True)
    for src, dest in LAYOUT.items():
        target = root / CONTAINER_DIR.lstrip("/") / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(release / src, target)
    info = tarball.with_name(tarball.name.removesuffix(".tar.zst") + ".info").read_text()
    return Userland(suite, root, info)


def in_pod(name: str) -> str:
    return f"{CONTAINER_DIR}/{LAYOUT[name]}"


def provider_path() -> str:
    """FI_PROVIDER_PATH exactly as the agent's Allocate answer sets it."""
    env = allocation_env(
        TransportSpec.model_validate({"mode": "metaroce"}),
        QosSpec.model_validate({"profile": "lossy"}),
        ["lo"],
        version="0.1.0",
        checksum="ab" * 32,
    )
    return env["FI_PROVIDER_PATH"]


def built_fi_version() -> tuple[int, int]:
    text = FABRIC_H.read_text()
    major = re.search(r"#define FI_MAJOR_VERSION (\d+)", text)
    minor = re.search(r"#define FI_MINOR_VERSION (\d+)", text)
    assert major and minor, f"{FABRIC_H}: no FI_MAJOR_VERSION/FI_MINOR_VERSION"
    return int(major.group(1)), int(minor.group(1))


def libfabric_version(u: Userland) -> tuple[int, int]:
    """The root's libfabric, as its fi_info reports it ("libfabric: 1.11.0")."""
    res = u.run(["fi_info", "--version"])
    m = re.search(r"libfabric: (\d+)\.(\d+)", res.stdout)
    assert res.returncode == 0 and m, f"{u.suite}: fi_info --version: {res.stdout}{res.stderr}"
    return int(m.group(1)), int(m.group(2))


def providers(u: Userland, env: dict[str, str] | None = None) -> set[str]:
    res = u.run(["fi_info", "-l"], env)
    assert res.returncode == 0, f"{u.suite}: fi_info -l: {res.stdout}{res.stderr}"
    return set(re.findall(r"^(\S+):$", res.stdout, re.M))


def why_not_loaded(u: Userland) -> str:
    """What the root's libfabric logs about the provider (dlopen errors, versions)."""
    log = u.run(
        ["fi_info", "-p", "metaroce"],
        {"FI_PROVIDER_PATH": provider_path(), "FI_LOG_LEVEL": "info"},
    )
    said = [ln for ln in log.stderr.splitlines() if "metaroce" in ln or "version" in ln.lower()]
    found, built = libfabric_version(u), built_fi_version()
    return (
        f"{u.suite}: libfabric {found[0]}.{found[1]} ({_line(u.info, 'libfabric1')}), the"
        f" provider declares FI_VERSION({built[0]}, {built[1]}) (built against {FABRIC_H});"
        f" libfabric logged: {said[-4:]}"
    )


def _line(info: str, key: str) -> str:
    return next((ln for ln in info.splitlines() if ln.startswith(key)), f"{key}: ?")


def test_every_file_resolves_its_libraries_and_glibc_versions(userland: Userland) -> None:
    libc = userland.run(["ldd", "--version"])
    print(f"{userland.suite}: {libc.stdout.splitlines()[0]}; {_line(userland.info, 'libfabric1')}")
    major, _ = libfabric_version(userland)
    for name in LAYOUT:
        res = userland.run(["ldd", in_pod(name)])
        out = res.stdout + res.stderr
        if name == "libmetaroce-v2-fi.so" and major < 2:
            # by design: a 1.x libfabric cannot load the 2.x build (its fi_dupinfo is
            # FABRIC_1.8); everything else it needs must still resolve
            expected = "libfabric.so.1: version `FABRIC_1.8' not found"
            out = "\n".join(ln for ln in out.splitlines() if expected not in ln)
            assert "not found" not in out, f"{userland.suite}: {name}: {out}"
            continue
        assert res.returncode == 0 and "not found" not in out, f"{userland.suite}: {name}: {out}"


def test_nccl_plugin_is_dlopened_and_moves_data(userland: Userland) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        bootstrap = f"127.0.0.1:{s.getsockname()[1]}"
    env = userland.env(
        {
            "LD_LIBRARY_PATH": f"{CONTAINER_DIR}/lib",
            "NCCL_NET_PLUGIN": "metaroce",
            "MR_NCCL_IFNAME": "=lo",
        }
    )
    argv = [in_pod("nccl/nccl-net-check"), "--version", "12", "--bootstrap", bootstrap,
            "--ifname", "lo", "--bulk-mib", "8", "--timeout", "60"]  # fmt: skip
    procs = []
    for rank in (0, 1):
        cmd = userland.command([*argv, "--rank", str(rank)])
        procs.append(
            subprocess.Popen(
                cmd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
        time.sleep(0.2)  # rank 0 listens on the bootstrap address first
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            outs.append(p.communicate()[0] + "\n(killed after 90 s)")
    log = "".join(f"--- rank {r} (rc {p.returncode})\n{o[-3000:]}" for r, (p, o) in
                  enumerate(zip(procs, outs, strict=True)))  # fmt: skip
    for rank, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0 and f"ALL OK rank {rank}" in out, f"{userland.suite}:\n{log}"


def test_libfabric_lists_the_provider_beside_the_images_own(userland: Userland) -> None:
    own = providers(userland)
    assert own, f"{userland.suite}: fi_info -l lists no provider without FI_PROVIDER_PATH"
    appended = providers(userland, {"FI_PROVIDER_PATH": provider_path()})
    assert own <= appended, f"{userland.suite}: FI_PROVIDER_PATH hid {sorted(own - appended)}"
    assert "metaroce" in appended, why_not_loaded(userland)
    # fi_info asks for the library's own API version (2.1 on trixie)
    res = userland.run(
        ["fi_info", "-p", "metaroce"],
        {"FI_PROVIDER_PATH": provider_path(), "FI_LOG_LEVEL": "warn"},
    )
    assert res.returncode == 0 and "provider: metaroce" in res.stdout, why_not_loaded(userland)
    # the build that registered is the one for this libfabric's fi_info layout
    stepped_aside = "writes fi_info as FABRIC_1.3" in res.stderr and "not registering" in res.stderr
    major, _ = libfabric_version(userland)
    assert stepped_aside == (major >= 2), (userland.suite, res.stderr[-2000:])
    print(f"{userland.suite}: image's providers {sorted(own)}, with FI_PROVIDER_PATH also metaroce"
          f" ({'the 2.x build' if major >= 2 else 'the 1.x build'})")  # fmt: skip


def test_provider_selftest_on_loopback(userland: Userland) -> None:
    env = {"FI_PROVIDER_PATH": provider_path(), "MR_CONFIG": "addr=127.0.0.1"}
    res = userland.run([in_pod("libfabric/selftest")], env, timeout=120)
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "ALL-OK" in out, f"{out[-3000:]}\n{why_not_loaded(userland)}"
