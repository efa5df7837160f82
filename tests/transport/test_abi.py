"""The transport's ABI towards training images (issue 14 item 5): the glibc it needs and
the C++ runtime it must not need.

Training images bring their own glibc (Debian 11 has 2.31, RHEL 8 and its clones 2.28,
Ubuntu 20.04 2.31), and a library the agent mounts into their pods must load there. The
declared floor is `GLIBC_FLOOR`; `objdump -T` lists the versioned symbols each shipped
file needs. No file may need libstdc++ (`readelf -d` NEEDED): an image's own libstdc++
(CUDA's, a conda one) would be the one loaded.

hack/build-transport.sh links everything against glibc 2.28's symbol versions (`cargo
zigbuild --target x86_64-unknown-linux-gnu.2.28`, `zig cc -target x86_64-linux-gnu.2.28`
for the C parts), whatever the build host's glibc (Debian 12: 2.36, where a plain build
needed GLIBC_2.34: pthread_* and dlsym moved into libc in 2.34, fstat64 2.33). The files
are checked from the build script's own answer: a host `cargo test --release` in the
same target directory puts host-linked copies of libmetaroce.so and metaroce-perf into
its release directory, which the build script replaces again.
test_old_userland.py loads them in a Debian 11 root.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.transport

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "hack" / "build-transport.sh"
SHIPPED = (
    "libmetaroce-fi.so",
    "libmetaroce-v2-fi.so",
    "libnccl-net-metaroce.so",
    "metaroce-perf",
    "nccl/nccl-net-check",
    "libfabric/selftest",
)
"""What hack/stage-transport.sh puts into the agent image and pods get mounted."""
GLIBC_FLOOR = (2, 28)
"""hack/build-transport.sh's GLIBC_FLOOR."""
ALLOWED_NEEDED = {
    "libc.so.6",
    "libm.so.6",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
    "libgcc_s.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
    "libfabric.so.1",
}
"""glibc's own libraries, the unwinder, and the image's libfabric (provider only)."""


@pytest.fixture(scope="module")
def shipped() -> list[Path]:
    """The shipped files, from the release directory hack/build-transport.sh prints
    (warm: seconds)."""
    built = subprocess.run(
        ["bash", str(BUILD_SCRIPT)], capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
    assert built.returncode == 0, f"{BUILD_SCRIPT} failed:\n{built.stderr[-3000:]}"
    release = Path(built.stdout.strip().splitlines()[-1])
    files = [release / name for name in SHIPPED]
    missing = [str(f) for f in files if not f.is_file()]
    assert not missing, f"{BUILD_SCRIPT} succeeded but {missing} are missing"
    return files


def glibc_needs(path: Path) -> dict[tuple[int, ...], set[str]]:
    """GLIBC_ version -> the symbols `path` needs at that version (objdump -T)."""
    out = subprocess.run(
        ["objdump", "-T", str(path)], capture_output=True, text=True, check=True
    ).stdout
    needs: dict[tuple[int, ...], set[str]] = {}
    for line in out.splitlines():
        m = re.search(r"\bGLIBC_([0-9.]+)\)?\s+(\S+)$", line)
        if m and "*UND*" in line:
            version = tuple(int(p) for p in m.group(1).split("."))
            needs.setdefault(version, set()).add(m.group(2))
    return needs


def needed(path: Path) -> set[str]:
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    return set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out))


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


def above(files: list[Path], limit: tuple[int, ...]) -> dict[str, str]:
    """Per file: the versions above `limit` it needs, with a few symbols each."""
    out = {}
    for f in files:
        needs = glibc_needs(f)
        assert needs, f"{f}: objdump -T found no GLIBC_ symbol at all"
        high = {v: s for v, s in needs.items() if v > limit}
        if high:
            out[f.name] = "; ".join(
                f"{_fmt(v)}: {', '.join(sorted(s)[:4])}" for v, s in sorted(high.items())
            )
    return out


def test_no_shipped_file_needs_a_glibc_above_the_floor(shipped: list[Path]) -> None:
    high = above(shipped, GLIBC_FLOOR)
    assert not high, f"symbols above GLIBC_{_fmt(GLIBC_FLOOR)}: {high}"
    tops = {f.name: _fmt(max(glibc_needs(f))) for f in shipped}
    print(f"highest GLIBC_ needed per shipped file: {tops}")


def test_no_shipped_file_needs_libstdcxx_or_an_unexpected_library(shipped: list[Path]) -> None:
    for f in shipped:
        libs = needed(f)
        assert libs, f"{f}: readelf -d found no NEEDED entry (not a dynamic ELF?)"
        assert not any("stdc++" in lib or "c++" in lib for lib in libs), (f.name, libs)
        assert libs <= ALLOWED_NEEDED, f"{f.name} needs {sorted(libs - ALLOWED_NEEDED)}"
        if f.name == "libnccl-net-metaroce.so":  # NCCL's plugin must not drag libfabric in
            assert "libfabric.so.1" not in libs, libs
