"""The one door to the host: files under a root directory, commands, and netlink.

Every sysfs, configfs, procfs, ``/dev`` and agent-state path the agent touches goes
through `Host`, which takes a root directory: the agent uses ``/`` (nothing else: there
is no fixture mode in production code). Commands (``rdma``, ``dcb``, ``ip``, ``tc``,
``modprobe``) go through one `CommandRunner` that logs what it ran; netlink (MTU,
addresses) through `Netlink` (pyroute2). The unit tests' `FixtureHost`
(tests/unit/agent/fakes.py) subclasses `Host` over a fixture tree, with a runner that
records argv and replays canned outputs and a netlink over the tree.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shlex
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from metaroce_api.failpoints import failpoint

log = logging.getLogger("metaroce.agent.host")

ALLOWED_PREFIXES = (
    "/sys",
    "/proc",
    "/dev",
    "/run/metaroce",
    "/etc/metaroce",
    "/etc/cni/multus/net.d",  # podNetwork: the node's CNI configuration of the network's NAD
)
"""Absolute paths the agent may touch (relative to the root); anything else is a bug."""


class HostError(RuntimeError):
    """A host operation failed; the message says what, where and what to do."""


class CommandError(HostError):
    """A command exited non-zero (or could not start)."""

    def __init__(self, result: CommandResult) -> None:
        self.result = result
        detail = (result.stderr or result.stdout).strip().splitlines()
        tail = detail[-1] if detail else "no output"
        super().__init__(f"`{result.command}` failed (exit {result.rc}): {tail}")


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    rc: int
    stdout: str = ""
    stderr: str = ""
    seconds: float = 0.0

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def ok(self) -> bool:
        return self.rc == 0


class CommandRunner(Protocol):
    """Runs a command; `check` raises `CommandError` on a non-zero exit."""

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult: ...


@dataclass
class SubprocessRunner:
    """The real runner: runs argv (no shell), logs each command and keeps a short history."""

    history: collections.deque[CommandResult] = field(
        default_factory=lambda: collections.deque(maxlen=200)
    )

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        args = tuple(str(a) for a in argv)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                args, capture_output=True, text=True, timeout=timeout, check=False
            )
            result = CommandResult(
                args, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start
            )
        except FileNotFoundError:
            result = CommandResult(
                args,
                127,
                "",
                f"{args[0]}: command not found (install it: iproute2, rdma-core or kmod)",
                time.monotonic() - start,
            )
        except subprocess.TimeoutExpired:
            result = CommandResult(
                args, 124, "", f"timed out after {timeout:.0f} s", time.monotonic() - start
            )
        self.history.append(result)
        level = logging.DEBUG if result.ok else logging.INFO
        log.log(
            level,
            "ran: %s (exit %d, %.0f ms)%s",
            result.command,
            result.rc,
            result.seconds * 1000,
            f": {result.stderr.strip()[:300]}" if not result.ok and result.stderr else "",
        )
        if check and not result.ok:
            raise CommandError(result)
        return result


class Netlink(Protocol):
    """The netlink operations the agent needs."""

    def set_mtu(self, ifname: str, mtu: int) -> None: ...

    def ipv4_addresses(self, ifname: str) -> list[str]: ...

    def ipv6_addresses(self, ifname: str) -> list[str]: ...

    def link_kind(self, ifname: str) -> str | None: ...

    def qdisc_kinds(self, ifname: str) -> list[str]: ...


class Host:
    """Files under `root`, commands through `runner`, netlink through `netlink`."""

    uses_kernel: bool = True
    """Whether the kernel behind the files is this machine's (pyverbs, pyroute2 see it).
    Only the tests' fixture host, a subclass with its own netlink over a fixture tree,
    says False: production code has no switch to a fixture mode."""

    def __init__(
        self,
        root: Path | str = "/",
        runner: CommandRunner | None = None,
        netlink: Netlink | None = None,
    ) -> None:
        self.root = Path(root)
        if self.uses_kernel and self.root != Path("/"):
            raise ValueError(
                f"host root {root}: the agent works on the node itself (/); a fixture tree "
                "is the tests' FixtureHost (tests/unit/agent/fakes.py)"
            )
        self.runner: CommandRunner = runner or SubprocessRunner()
        if netlink is None and not self.uses_kernel:
            raise ValueError("a host without the kernel needs its own netlink")
        self.netlink: Netlink = netlink or PyRoute2Netlink()

    @property
    def is_real(self) -> bool:
        """True for the machine's own kernel, False for the tests' fixture host."""
        return self.uses_kernel

    # --- paths -----------------------------------------------------------------------
    def path(self, path: str) -> Path:
        if not path.startswith("/"):
            raise ValueError(f"host path {path!r} must be absolute (e.g. /sys/class/net)")
        if not any(path == p or path.startswith(p + "/") for p in ALLOWED_PREFIXES):
            raise ValueError(f"host path {path} is outside {', '.join(ALLOWED_PREFIXES)}")
        return self.root / path.lstrip("/")

    def read(self, path: str) -> str:
        """The content of a file, stripped; raises `HostError` naming the path."""
        try:
            with open(self.path(path), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError as e:
            raise HostError(f"cannot read {path}: {e.strerror or e}") from e

    def read_opt(self, path: str) -> str | None:
        """The content of a file, or None when it is missing or unreadable."""
        try:
            with open(self.path(path), encoding="utf-8", errors="replace") as f:
                return f.read().strip()
        except OSError:
            return None

    def read_int(self, path: str) -> int | None:
        text = self.read_opt(path)
        if text is None:
            return None
        try:
            return int(text.split()[0], 0)
        except (ValueError, IndexError):
            return None

    def write(self, path: str, value: str) -> None:
        """Write `value` to a file (sysfs/configfs style: one write, no truncation games)."""
        log.debug("write %s <- %r", path, value)
        try:
            fd = os.open(self.path(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as e:
            raise HostError(f"cannot write {value!r} to {path}: {e.strerror or e}") from e

    def write_atomic(self, path: str, value: str) -> None:
        """Write a regular file so that a crash leaves either the old or the new content
        (agent state): a temporary file, fsync, rename over the target, fsync of the
        directory (which makes the rename itself durable)."""
        target = self.path(path)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, value.encode("utf-8"))
                os.fsync(fd)
            finally:
                os.close(fd)
            failpoint("write_atomic.before_rename")  # the new content durable, not in place
            os.replace(tmp, target)
            dirfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise HostError(f"cannot write {path}: {e.strerror or e}") from e

    def rename(self, path: str, new_path: str) -> None:
        try:
            os.replace(self.path(path), self.path(new_path))
        except OSError as e:
            raise HostError(f"cannot rename {path} to {new_path}: {e.strerror or e}") from e

    def exists(self, path: str) -> bool:
        return os.path.lexists(self.path(path))

    def is_dir(self, path: str) -> bool:
        return self.path(path).is_dir()

    def listdir(self, path: str) -> list[str]:
        """Sorted entries of a directory; empty when it is missing or unreadable."""
        try:
            return sorted(os.listdir(self.path(path)))
        except OSError:
            return []

    def readlink_name(self, path: str) -> str | None:
        """The last component of a symlink's target (e.g. a driver name), or None."""
        try:
            return os.path.basename(os.readlink(self.path(path)))
        except OSError:
            return None

    def resolve(self, path: str) -> str | None:
        """The resolved absolute host path of a symlink chain, or None."""
        try:
            real = os.path.realpath(self.path(path), strict=True)
        except OSError:
            return None
        root = os.path.realpath(self.root)
        rel = os.path.relpath(real, root)
        return "/" + rel if rel != "." else "/"

    def mkdir(self, path: str) -> None:
        try:
            os.mkdir(self.path(path))
        except FileExistsError:
            return
        except OSError as e:
            raise HostError(f"cannot create {path}: {e.strerror or e}") from e

    def rmdir(self, path: str) -> None:
        try:
            os.rmdir(self.path(path))
        except FileNotFoundError:
            return
        except OSError as e:
            raise HostError(f"cannot remove {path}: {e.strerror or e}") from e

    def remove(self, path: str) -> None:
        try:
            os.unlink(self.path(path))
        except FileNotFoundError:
            return
        except OSError as e:
            raise HostError(f"cannot remove {path}: {e.strerror or e}") from e

    def read_dir_values(self, path: str) -> dict[str, str]:
        """`{name: content}` of the readable regular files of a directory (counters).

        Fast path for the exporter (a scrape reads ~1000 files on an 8-NIC node): the
        directory is opened once and each file read with one `os.read` relative to it;
        unreadable files and subdirectories (EISDIR) are skipped.
        """
        out: dict[str, str] = {}
        try:
            dfd = os.open(self.path(path), os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return out
        try:
            for name in os.listdir(dfd):
                try:
                    fd = os.open(name, os.O_RDONLY, dir_fd=dfd)
                except OSError:
                    continue
                try:
                    out[name] = os.read(fd, 64).decode("ascii", "replace").strip()
                except OSError:
                    continue
                finally:
                    os.close(fd)
        finally:
            os.close(dfd)
        return out

    # --- commands --------------------------------------------------------------------
    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout: float = 60.0
    ) -> CommandResult:
        return self.runner.run(argv, check=check, timeout=timeout)

    def own_fds_holding(self, device_paths: Iterable[str]) -> int:
        """How many of this process's descriptors are open on one of `device_paths`."""
        wanted = set(device_paths)
        count = 0
        for fd in self.listdir("/proc/self/fd") if wanted else []:
            try:
                if os.readlink(self.path(f"/proc/self/fd/{fd}")) in wanted:
                    count += 1
            except OSError:
                continue
        return count

    def pids_holding(self, device_paths: Iterable[str]) -> dict[int, str]:
        """`{pid: comm}` of processes with one of `device_paths` (e.g. /dev/infiniband/
        uverbs0) open, from /proc/<pid>/fd."""
        wanted = set(device_paths)
        holders: dict[int, str] = {}
        if not wanted:
            return holders
        for entry in self.listdir("/proc"):
            if not entry.isdigit():
                continue
            fd_dir = f"/proc/{entry}/fd"
            for fd in self.listdir(fd_dir):
                try:
                    target = os.readlink(self.path(f"{fd_dir}/{fd}"))
                except OSError:
                    continue
                if target in wanted:
                    holders[int(entry)] = self.read_opt(f"/proc/{entry}/comm") or "?"
                    break
        return holders


# --- netlink ----------------------------------------------------------------------------


class PyRoute2Netlink:
    """Netlink through pyroute2 (imported lazily: unit tests never need it)."""

    def _ipr(self) -> Any:
        from pyroute2 import IPRoute

        return IPRoute()

    def _index(self, ipr: Any, ifname: str) -> int:
        found = ipr.link_lookup(ifname=ifname)
        if not found:
            raise HostError(f"no network interface {ifname}")
        return int(found[0])

    def set_mtu(self, ifname: str, mtu: int) -> None:
        log.info("netlink: set mtu %d on %s", mtu, ifname)
        with self._ipr() as ipr:
            try:
                ipr.link("set", index=self._index(ipr, ifname), mtu=mtu)
            except Exception as e:  # pyroute2's NetlinkError carries the errno
                code = getattr(e, "code", None)
                why = os.strerror(code) if isinstance(code, int) else str(e)
                raise HostError(f"netlink: cannot set mtu {mtu} on {ifname}: {why}") from e

    def ipv4_addresses(self, ifname: str) -> list[str]:
        with self._ipr() as ipr:
            try:
                msgs = ipr.get_addr(family=2, index=self._index(ipr, ifname))
            except HostError:
                return []
            return [str(m.get_attr("IFA_ADDRESS")) for m in msgs]

    def ipv6_addresses(self, ifname: str) -> list[str]:
        with self._ipr() as ipr:
            try:
                msgs = ipr.get_addr(family=10, index=self._index(ipr, ifname))
            except HostError:
                return []
            return [str(m.get_attr("IFA_ADDRESS")) for m in msgs]

    def qdisc_kinds(self, ifname: str) -> list[str]:
        """Kinds of the qdiscs on a link (e.g. ["fq_codel", "clsact"]), one netlink dump."""
        with self._ipr() as ipr:
            msgs = ipr.get_qdiscs(index=self._index(ipr, ifname))
            return [str(m.get_attr("TCA_KIND")) for m in msgs if m.get_attr("TCA_KIND")]

    def link_kind(self, ifname: str) -> str | None:
        """IFLA_INFO_KIND of a virtual link (veth, dummy, bridge...), None for hardware."""
        with self._ipr() as ipr:
            try:
                links = ipr.get_links(self._index(ipr, ifname))
            except HostError:
                return None
            for link in links:
                info = link.get_attr("IFLA_LINKINFO")
                if info is not None:
                    kind = info.get_attr("IFLA_INFO_KIND")
                    return str(kind) if kind else None
            return None
