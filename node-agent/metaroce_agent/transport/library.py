"""The MetaRoCE transport's libraries: from the agent image into a versioned host directory.

The agent image carries the transport (`IMAGE_DIR`, staged by hack/stage-transport.sh):

    VERSION                        the transport's version (its crates' version)
    lib/libmetaroce-fi.so          the libfabric provider (FI_PROVIDER_PATH), for 1.x
    lib/libmetaroce-v2-fi.so       the same for libfabric 2.x (each build registers only
                                   in the libfabric whose fi_info layout it writes)
    lib/libnccl-net-metaroce.so    NCCL's net plugin (NCCL_NET_PLUGIN=metaroce)
    bin/metaroce-perf              bandwidth and latency tool
    bin/nccl-net-check             NCCL's call contract between two processes (self-test)
    bin/metaroce-fi-selftest       the provider through libfabric's API (self-test)

`MetaRoceLibraryStep` installs it as `/run/metaroce/transport/<network>/<version>-<sum>`,
where `<sum>` starts the bundle's checksum (sha256 of its `SHA256SUMS`): a directory is
written under a temporary name, checked, made read-only and root-owned, and renamed into
place whole. Files are never rewritten in place (a job that maps a rewritten `.so` dies
of SIGBUS): a new version is a new directory; a damaged one is moved aside, not
repaired. Pods are handed the versioned path itself (never a symlink), so an upgrade
leaves running pods on the version they started with. An old version is removed once no
pod holds a unit that was allocated with it (the kubelet re-uses a checkpointed
`Allocate` answer on a container restart): the device plugin records each unit's
version, the kubelet's PodResources API says which units pods hold
(`remove_unused_versions`), and a version some process still maps is never removed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from metaroce_agent.host import Host
from metaroce_agent.steps import Json, Step, StepError

IMAGE_DIR = "/opt/metaroce/transport"
"""Where the agent image carries the transport (METAROCE_TRANSPORT_DIR overrides it)."""
HOST_ROOT = "/run/metaroce/transport"
"""Host directory of the installed versions, one subdirectory per network."""
PROVIDER = "lib/libmetaroce-fi.so"
NCCL_PLUGIN = "lib/libnccl-net-metaroce.so"
PERF = "bin/metaroce-perf"
NCCL_CHECK = "bin/nccl-net-check"
FI_SELFTEST = "bin/metaroce-fi-selftest"
PROVIDER_V2 = "lib/libmetaroce-v2-fi.so"
FILES = (PROVIDER, PROVIDER_V2, NCCL_PLUGIN, PERF, NCCL_CHECK, FI_SELFTEST)
SUMS = "SHA256SUMS"
SELFTEST_TIMEOUT_S = 300.0  # above the self-test's three parts of selftest.TIMEOUT_S each


def image_dir() -> str:
    return os.environ.get("METAROCE_TRANSPORT_DIR", IMAGE_DIR)


@dataclass(frozen=True)
class Bundle:
    """The transport as the agent image carries it."""

    source: str
    version: str
    checksum: str
    """sha256 of `sums` (so of every file's content and name)."""
    sums: str
    """`sha256sum` lines of `FILES`, in that order."""

    @property
    def dir_name(self) -> str:
        return f"{self.version}-{self.checksum[:16]}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sums_of(directory: Path) -> str:
    return "".join(f"{_sha256(directory / name)}  {name}\n" for name in FILES)


def read_bundle(source: str | None = None) -> tuple[Bundle | None, str]:
    """The bundle in the agent image, or (None, why not)."""
    root = Path(source or image_dir())
    missing = [name for name in FILES if not (root / name).is_file()]
    if missing:
        return None, (
            f"the agent image has no MetaRoCE transport in {root} (missing "
            f"{', '.join(missing)}): use an agent image built by hack/build-images.sh, or "
            "stage one with hack/stage-transport.sh"
        )
    try:
        version = (root / "VERSION").read_text().strip()
    except OSError:
        version = ""
    if not version or not all(c.isalnum() or c in ".-+_" for c in version):
        return None, f"{root}/VERSION is missing or not a version ({version!r})"
    sums = sums_of(root)
    return Bundle(str(root), version, hashlib.sha256(sums.encode()).hexdigest(), sums), ""


def install_dir(network: str, bundle_dir_name: str) -> str:
    return f"{HOST_ROOT}/{network}/{bundle_dir_name}"


def mapped_by(host: Host, directory: str) -> dict[int, str]:
    """Processes (in the agent's /proc) that map or hold open a file of `directory`:
    matched by device and inode, which hold whatever path a container mounted it at."""
    real = host.path(directory)
    inodes: set[tuple[int, int]] = set()
    for f in real.rglob("*") if real.is_dir() else ():
        with contextlib.suppress(OSError):
            st = f.stat()
            inodes.add((st.st_dev, st.st_ino))
    if not inodes:
        return {}
    out: dict[int, str] = {}
    own = os.getpid()
    for pid_s in host.listdir("/proc"):
        if not pid_s.isdigit() or int(pid_s) == own:
            continue
        maps = host.read_opt(f"/proc/{pid_s}/maps") or ""
        for line in maps.splitlines():
            parts = line.split()
            if len(parts) < 5 or parts[4] == "0":
                continue
            major, _, minor = parts[3].partition(":")
            with contextlib.suppress(ValueError):
                dev = os.makedev(int(major, 16), int(minor, 16))
                if (dev, int(parts[4])) in inodes:
                    out[int(pid_s)] = host.read_opt(f"/proc/{pid_s}/comm") or "?"
                    break
    return out


def _read_only_tree(path: Path) -> None:
    """Root-owned, no write bits: executables 0555, other files 0444, directories 0555."""
    for p in sorted(path.rglob("*"), reverse=True):
        os.chown(p, 0, 0, follow_symlinks=False)
        exec_bit = p.is_dir() or p.stat().st_mode & stat.S_IXUSR
        os.chmod(p, 0o555 if exec_bit else 0o444)
    os.chown(path, 0, 0)
    os.chmod(path, 0o555)


def _remove_tree(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        if p.is_dir() and not p.is_symlink():
            os.chmod(p, 0o755)
    shutil.rmtree(path)


def check_installed(directory: Path, sums: str) -> str | None:
    """What is wrong with an installed version (None: intact and read-only)."""
    if directory.is_symlink() or not directory.is_dir():
        return f"{directory} is missing"
    try:
        recorded = (directory / SUMS).read_text()
    except OSError:
        return f"{directory}/{SUMS} is missing"
    if recorded != sums:
        return f"{directory}/{SUMS} differs from the agent image's transport"
    try:
        actual = sums_of(directory)
    except OSError as e:
        return f"{directory}: cannot read a library ({e.strerror or e})"
    if actual != sums:
        bad = sorted(set(actual.splitlines()) - set(sums.splitlines()))
        return f"{directory}: content changed ({'; '.join(b.split()[-1] for b in bad)})"
    for p in [directory, *directory.rglob("*")]:
        st = p.lstat()
        if stat.S_ISLNK(st.st_mode):
            return f"{p} is a symlink"
        if st.st_uid != 0 or st.st_mode & 0o222:
            return f"{p} is not root-owned and read-only (mode {stat.S_IMODE(st.st_mode):o})"
    return None


@dataclass(frozen=True)
class MetaRoceLibraryStep(Step):
    """Install the transport's bundle as the network's versioned host directory and
    verify it with a real self-test (loopback transfers through the installed files)."""

    kind = "metaroce-library"
    knob = "transport-library"
    method = "install"

    source: str = IMAGE_DIR
    version: str = ""
    checksum: str = ""
    sums: str = ""
    network: str = ""

    @property
    def directory(self) -> str:
        return install_dir(self.network, f"{self.version}-{self.checksum[:16]}")

    def value(self) -> str:
        return f"{self.directory} (sha256 {self.checksum[:16]})"

    def snapshot(self, host: Host) -> Json:
        return {"existed": host.exists(f"{HOST_ROOT}/{self.network}")}

    def apply(self, host: Host) -> None:
        target = host.path(self.directory)
        if check_installed(target, self.sums) is None:
            return
        parent = target.parent
        parent.mkdir(parents=True, exist_ok=True)
        os.chmod(parent, 0o755)
        tmp = parent / f".{target.name}.{os.getpid()}.tmp"
        if tmp.exists():
            _remove_tree(tmp)
        try:
            src = Path(self.source)
            for name in FILES:
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src / name, tmp / name)
                mode = (src / name).stat().st_mode
                os.chmod(tmp / name, 0o555 if mode & stat.S_IXUSR else 0o444)
            (tmp / SUMS).write_text(self.sums)
            if sums_of(tmp) != self.sums:
                raise StepError(
                    f"the transport in {self.source} changed while it was copied: restart the agent"
                )
            _read_only_tree(tmp)
            for name in FILES:  # durable before it gets its name
                fd = os.open(tmp / name, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            if target.exists() or target.is_symlink():
                # damaged: moved aside whole (a pod may map it), never rewritten
                aside = parent / f".{target.name}.damaged-{int(time.time())}"
                os.rename(target, aside)
            os.rename(tmp, target)
        except OSError as e:
            raise StepError(
                f"cannot install the transport into {self.directory}: {e.strerror or e}"
            ) from e
        finally:
            if tmp.exists():
                _remove_tree(tmp)

    def verify(self, host: Host) -> str | None:
        wrong = check_installed(host.path(self.directory), self.sums)
        if wrong is not None:
            return wrong
        res = host.run(
            [
                sys.executable,
                "-m",
                "metaroce_agent.transport.selftest",
                str(host.path(self.directory)),
            ],
            check=False,
            timeout=SELFTEST_TIMEOUT_S,
        )
        if not res.ok:
            lines = (res.stdout + res.stderr).strip().splitlines()
            return (
                f"self-test of {self.directory} failed: {lines[-1] if lines else f'exit {res.rc}'}"
            )
        return None

    def check_drift(self, host: Host) -> str | None:
        # The self-test took 32 s of a 1-vCPU emulated node's CPU, and the drift pass
        # ran it every 5 minutes on every node at once, under the training pods. Files
        # that still match their checksums keep the verdict of the self-test that ran
        # when they were installed (or adopted after a restart).
        return check_installed(host.path(self.directory), self.sums)

    def undo(self, host: Host, snapshot: Json) -> None:
        """Remove every version of the network that no process maps; name those held."""
        net_dir = f"{HOST_ROOT}/{self.network}"
        held: list[str] = []
        for name in host.listdir(net_dir):
            version = f"{net_dir}/{name}"
            users = mapped_by(host, version)
            if users:
                who = ", ".join(f"{pid} ({comm})" for pid, comm in sorted(users.items()))
                held.append(f"{version} (mapped by {who})")
                continue
            _remove_tree(host.path(version))
        if held:
            raise StepError(
                f"transport versions left in place, still in use: {'; '.join(held)}; stop "
                "those pods, then run the revert again"
            )
        if isinstance(snapshot, dict) and snapshot.get("existed") is False:
            host.rmdir(net_dir)


# --- versions no pod holds -------------------------------------------------------------------

ALLOCATIONS_FILE = "metaroce-allocations.json"
"""In the agent's state directory of the network: `{unit id: library directory}` of the
last `Allocate` of each unit, which the kubelet re-uses on container restarts."""


def versions_to_remove(
    installed: list[str],
    current: str,
    allocations: dict[str, str],
    allocated: set[str],
) -> tuple[list[str], str]:
    """The installed version directories nothing needs any more, and why others stay.

    A version stays while a unit a pod holds now was last allocated with it; a held unit
    with no record (the record was lost) keeps every version, to be safe."""
    unknown = sorted(u for u in allocated if u not in allocations)
    if unknown:
        return [], f"units {', '.join(unknown)} are held with no record of their version"
    needed = {current} | {allocations[u] for u in allocated}
    return [d for d in installed if d not in needed], ""


def remove_unused_versions(
    host: Host, network: str, current: str, allocations: dict[str, str], allocated: set[str]
) -> tuple[list[str], list[str]]:
    """Remove the network's versions no pod holds (nor maps): (removed, why others stay)."""
    net_dir = f"{HOST_ROOT}/{network}"
    installed = [f"{net_dir}/{name}" for name in host.listdir(net_dir) if not name.startswith(".")]
    candidates, why = versions_to_remove(installed, current, allocations, allocated)
    notes = [why] if why else []
    removed = []
    for version in candidates:
        users = mapped_by(host, version)
        if users:
            notes.append(f"{version} is still mapped by {', '.join(map(str, sorted(users)))}")
            continue
        _remove_tree(host.path(version))
        removed.append(version)
    return removed, notes
