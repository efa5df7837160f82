"""SoftRoCE test guests: boot qemu guests running Debian's kernel with real rdma_rxe.

Each guest is a qemu (TCG) machine booted from the image that ``hack/build-guest.sh``
builds (Debian's ELF ``vmlinux``, a tiny initramfs and a Debian root with rdma-core,
pyverbs, perftest and tcpdump). Every guest gets:

- ``eth0`` on a private L2 shared by all guests of a cluster: a lossless link, because
  RoCE's go-back-N turns every lost frame into a stall. Each guest gets a tap device on
  a kernel bridge inside a network namespace of the harness's own (``_Bridge``: a small
  helper process holds the namespace; the tap file descriptors are handed to qemu,
  which keeps its user networking in the host namespace). Where a namespace or
  ``/dev/net/tun`` is not available (not root), the harness says so and falls back to
  ``_Hub``, a learning switch in this process between qemu ``-netdev dgram`` unix
  sockets. Either way ``GuestCluster.l2_counters()`` counts frames and drops, so a test
  can assert that a lossless arm lost nothing; loss belongs only where a test injects
  it (netem in a guest). No multicast, no host address. Guest ``node-N`` has
  ``192.168.77.(10+N)/24``.
- ``eth1`` on qemu user-mode networking (``10.0.2.15/24``, default route via
  ``10.0.2.2``), so the guest reaches the host's loopback services at ``10.0.2.2``.
- the repository shared read-only over 9p at ``/share`` and the guest's Python
  dependencies (``guest-python`` of the image) at ``/opt/guest-python``; every command's
  ``PYTHONPATH`` holds the project's package folders under ``/share`` and
  ``/opt/guest-python``. Debian's pyverbs comes from the image's python3.
- a root filesystem that is the image's ``root/`` (read-only over 9p) under a tmpfs
  overlay: the guest can write anywhere, nothing reaches the host, and it is gone when
  the guest stops. The kernel modules a test node needs (with their dependency
  closures) are in it; the initramfs only holds busybox and the virtio/9p/overlay
  modules that mounting it takes.
- hostname ``node-N`` (N counts from 1; ``cluster[0]`` is ``node-1``), and a command
  server (``hack/guest/guestd.py``) on a virtio-serial port, spoken to in JSON lines over
  a unix socket.

Usage::

    from metaroce_harness.guests import GuestCluster

    with GuestCluster(count=2, memory_mb=1024) as guests:
        r = guests[0].run("rdma link", timeout=30)
        r.returncode, r.stdout, r.stderr
        guests[1].run("modprobe rdma_rxe", check=True)
        guests[1].run_python("import pyverbs; print(pyverbs.__file__)")
        job = guests[0].start("tcpdump -ni eth0 -w /tmp/x.pcap udp port 4791")
        ...
        job.kill()                      # -> CommandResult with its output

API (all timeouts in seconds):

- ``GuestCluster(count=2, *, memory_mb=1024, cpus=1, share=REPO_ROOT, image=None,
  boot_timeout=120.0, boot_attempts=2, log_dir=None, kernel_args="", qemu=None,
  shares=None, host_forwards=None)``: ``shares`` maps guest paths to host directories
  shared read-only over 9p; ``host_forwards(index)`` gives qemu ``hostfwd`` rules for
  guest ``index``'s user-net NIC (e.g. ``tcp:127.0.0.1:8080-:80``).
  ``start()``/``close()`` or a ``with`` block; ``len()``, indexing and iteration give
  ``Guest`` objects; ``run_all(cmd, **kw)`` runs a command on every guest in parallel.
  Booting is parallel; a guest that does not come up within ``boot_timeout`` (a hung
  boot), or whose clock is wrong (``clock_is_wrong``), is killed and booted again,
  ``boot_attempts`` times in all.
- ``Guest.run(cmd, *, timeout=60.0, check=False, env=None, cwd=None, input=None)
  -> CommandResult`` where ``cmd`` is a ``bash -c`` string or an argv list. Raises
  ``GuestTimeoutError`` (with the partial result) when the command outlives ``timeout``
  (its process group is killed) and ``GuestCommandError`` for a non-zero exit when
  ``check``. ``run`` returns when the command's own process exits, even if it left
  children running.
- ``Guest.run_python(code, *args, **run_kw)`` and ``Guest.run_python_file(host_path,
  *args, **run_kw)`` run the guest's python3 (the latter on a file of the share).
- ``Guest.start(cmd, *, env=None, cwd=None, input=None) -> BackgroundCommand`` with
  ``wait(timeout) -> CommandResult`` (``GuestTimeoutError`` if still running),
  ``poll() -> CommandResult | None``, ``output() -> (stdout, stderr)`` so far and
  ``kill(sig=SIGTERM, timeout=10.0) -> CommandResult``.
- ``Guest.read_file(path) -> bytes``, ``Guest.write_file(path, data, mode=0o644)``,
  ``Guest.guest_path(host_path) -> str`` (a host path under the share, seen in the guest).
- ``Guest`` attributes: ``index`` (0-based), ``name`` (``node-N``), ``ip``, ``mac``,
  ``console_log`` (the serial console, named in every error), ``boot_seconds``.
- ``find_image(build=True) -> GuestImage`` runs ``hack/build-guest.sh`` (a no-op when
  cached) or takes ``$METAROCE_GUEST_IMAGE``.
- ``GuestCluster.l2_counters() -> L2Counters`` (``kind`` "bridge" or "hub", ``frames``,
  ``dropped``): what the private L2 carried and dropped since the cluster started;
  ``Guest.tx_stalls()``: how often the guest's kernel saw a NIC transmit queue stuck;
  ``GuestCluster.l2_report() -> str``: the L2 as it is now (the bridge's per-tap
  counters and learned MACs; per guest the NIC's counters, neighbours, qdiscs, a ping of
  each other guest and the kernel's last lines), over the command channel, not the L2,
  and ``Guest.nic_queues()``: qemu's view of the L2 NIC's rings over QMP
  (``Guest.qmp_socket``; ``l2_health`` finds a dead L2 and revives it).
- ``leftovers(owner_pid=None) -> list[str]``: qemu processes, L2 bridge helpers and run
  directories of this harness still present (for leak checks). ``boot_history`` lists every boot of
  this process (guest count, seconds, seconds per guest, attempts per guest).

Cleanup: ``close()`` (also from ``__exit__``, from ``atexit`` and on SIGTERM/SIGHUP,
which raise ``KeyboardInterrupt`` so that ``with`` blocks and pytest teardowns run)
kills every qemu and removes the run directory (sockets under ``/tmp``); further
signals are held off while it runs. qemu also gets SIGKILL if this process dies
(``setpriv --pdeathsig``), and run directories whose owner died are swept at the next
start. Console logs are kept under
``${XDG_CACHE_HOME:-~/.cache}/metaroce/guest-logs/<run>/`` (the last 20 runs).

Command line: ``python -m metaroce_harness.guests up --count 2`` boots guests and stays
up until Ctrl-C; ``python -m metaroce_harness.guests run --node 1 -- rdma link`` runs a
command in a guest of that running cluster.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import itertools
import json
import logging
import os
import queue
import select
import shlex
import shutil
import signal
import socket
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from metaroce_harness.qmp import QmpError, qmp_command

log = logging.getLogger("metaroce.guests")

L2_NETDEV_ID = "l2"
"""The qemu netdev (backend) of each guest's private L2: QMP's ``set_link`` names it."""
L2_NIC_ID = "l2nic"
"""The qemu device id of each guest's NIC on the private L2 (its ``eth0``)."""
L2_NIC_PATH = f"/machine/peripheral/{L2_NIC_ID}/virtio-backend"

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-guest.sh"
GUEST_SHARE = "/share"
GUEST_PYTHON_DIR = "/opt/guest-python"
# The folders of pyproject.toml's packages; under the share they go on PYTHONPATH.
PACKAGE_DIRS = ("api", "operator", "node-agent", "hack", "cli")
L2_PREFIX = "192.168.77."

RUN_DIR_PREFIX = "metaroce-guests-"
RUN_DIR_PARENT = Path("/tmp")  # unix socket paths must stay short
CMD_PORT_NAME = "org.metaroce.cmd"
# How much longer than a command's own timeout the host waits for the guest's reply.
REPLY_MARGIN = 30.0
KEEP_LOG_RUNS = 20
SEND_TIMEOUT = 0.2  # how long the L2 hub waits for a guest's full receive queue
_QBOOT = Path("/usr/share/qemu/qboot.rom")
# Boot fast under TCG: no CPU bug mitigations, no crypto self-tests, no LSMs, and PCI
# interrupts routed without the ACPI interpreter (with it, probing the virtio devices
# alone took 6-12 s on a busy host).
DEFAULT_KERNEL_ARGS = (
    "console=ttyS0 panic=-1 quiet mitigations=off audit=0 apparmor=0 security=none "
    "tsc=reliable no_timer_check random.trust_cpu=on 8250.nr_uarts=1 cryptomgr.notests "
    "acpi=noirq"
)


def guest_ip(index: int) -> str:
    """eth0 address of the guest with 0-based `index` (``node-N`` has ``192.168.77.(10+N)``)."""
    return f"{L2_PREFIX}{11 + index}"


class GuestError(RuntimeError):
    """Base of the harness's errors."""


class GuestImageError(GuestError):
    """The guest image is missing and could not be built."""


class GuestBootError(GuestError):
    """A guest did not boot (after its retries)."""


class GuestCommandError(GuestError):
    """A command run with ``check=True`` exited non-zero."""

    def __init__(self, message: str, result: CommandResult) -> None:
        super().__init__(message)
        self.result = result


class GuestTimeoutError(GuestError):
    """A command or the guest itself did not answer in time."""

    def __init__(self, message: str, result: CommandResult | None = None) -> None:
        super().__init__(message)
        self.result = result


# --- the image -----------------------------------------------------------------------


@dataclass(frozen=True)
class GuestImage:
    """A built guest: ``vmlinux``, ``initramfs.cpio``, ``root/`` and ``guest-python/``."""

    root: Path
    vmlinux: Path
    initramfs: Path
    guest_python: Path
    kernel_release: str
    rootfs: Path  # the guest's root, shared read-only over 9p (tag "root")

    @classmethod
    def from_dir(cls, root: Path) -> GuestImage:
        root = Path(root)
        missing = [
            name
            for name in ("vmlinux", "initramfs.cpio", "guest-python", "root", ".complete")
            if not (root / name).exists()
        ]
        if missing:
            raise GuestImageError(
                f"{root} is not a finished guest image (missing {', '.join(missing)}): "
                f"run {BUILD_SCRIPT}"
            )
        manifest: dict[str, str] = {}
        with contextlib.suppress(OSError):
            for line in (root / "manifest.env").read_text().splitlines():
                k, _, v = line.partition("=")
                manifest[k] = v
        return cls(
            root=root,
            vmlinux=root / "vmlinux",
            initramfs=root / "initramfs.cpio",
            guest_python=(root / "guest-python").resolve(),
            kernel_release=manifest.get("KERNEL_RELEASE", "?"),
            rootfs=root / "root",
        )


def build_image() -> GuestImage:
    """Run ``hack/build-guest.sh`` (fast when the image is cached) and return the image."""
    if not BUILD_SCRIPT.exists():
        raise GuestImageError(f"the guest build script {BUILD_SCRIPT} is missing")
    log.info("guest image: running %s", BUILD_SCRIPT)
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out_lines: list[str] = []
    reader = threading.Thread(
        target=lambda: out_lines.extend(proc.stdout.readlines()) if proc.stdout else None,
        daemon=True,
    )
    reader.start()
    err_tail: list[str] = []
    for line in proc.stderr:
        line = line.rstrip("\n")
        log.info("%s", line)
        err_tail = [*err_tail[-30:], line]
    rc = proc.wait()
    reader.join()
    if rc != 0 or not out_lines:
        tail = "\n".join(err_tail[-15:])
        raise GuestImageError(f"{BUILD_SCRIPT} failed (exit {rc}):\n{tail}")
    return GuestImage.from_dir(Path(out_lines[-1].strip()))


def find_image(build: bool = True) -> GuestImage:
    """The guest image: ``$METAROCE_GUEST_IMAGE`` if set, else built (or reused) now."""
    env = os.environ.get("METAROCE_GUEST_IMAGE")
    if env:
        return GuestImage.from_dir(Path(env))
    if not build:
        raise GuestImageError(
            f"no guest image given: set METAROCE_GUEST_IMAGE or run {BUILD_SCRIPT}"
        )
    return build_image()


# --- results -------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    """What a command did in a guest."""

    guest: str
    command: str | list[str]
    returncode: int
    stdout: str
    stderr: str
    duration: float
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def describe(self) -> str:
        cmd = self.command if isinstance(self.command, str) else shlex.join(self.command)
        state = "timed out" if self.timed_out else f"exit {self.returncode}"
        return (
            f"{self.guest}: `{_short(cmd, 300)}` {state} after {self.duration:.1f} s\n"
            f"--- stdout ---\n{_short(self.stdout, 4000, tail=True)}\n"
            f"--- stderr ---\n{_short(self.stderr, 4000, tail=True)}"
        )

    def check(self) -> CommandResult:
        """Raise ``GuestCommandError`` unless the command exited 0."""
        if not self.ok:
            raise GuestCommandError(self.describe(), self)
        return self


def _short(text: str, limit: int, tail: bool = False) -> str:
    if len(text) <= limit:
        return text
    return "[...]" + text[-limit:] if tail else text[:limit] + "[...]"


# --- process spawning ----------------------------------------------------------------

# qemu gets SIGKILL when the thread that spawned it exits (PR_SET_PDEATHSIG), so every
# qemu is spawned from one long-lived daemon thread: it dies only with this process.
_spawn_queue: queue.Queue[tuple[Callable[[], subprocess.Popen[bytes]], Future[Any]]] = queue.Queue()
_spawner_lock = threading.Lock()
_spawner: threading.Thread | None = None


def _spawner_loop() -> None:
    while True:
        fn, fut = _spawn_queue.get()
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)


def _spawn(argv: list[str], **kw: Any) -> subprocess.Popen[bytes]:
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawner_loop, name="guest-spawner", daemon=True)
            _spawner.start()
    fut: Future[subprocess.Popen[bytes]] = Future()
    setpriv = shutil.which("setpriv")
    full = [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else argv
    _spawn_queue.put((lambda: subprocess.Popen(full, **kw), fut))
    return fut.result(timeout=60)


# --- the private L2 ------------------------------------------------------------------

BRIDGE_MARKER = "metaroce-l2-bridge"  # in the helper's argv, for leftovers()
# Frames a tap queues for a guest that is not reading (a TCG guest stalls for tens of
# milliseconds under load): the kernel's default of 1000 is a few milliseconds of a
# busy RDMA stream.
TAP_QUEUE_LEN = 10000

# The helper runs in a new network namespace (`unshare --net`): it makes the bridge and
# one tap per guest, sends the taps' file descriptors back over the socket it inherited
# (argv: marker, run dir, guest count, socket fd, tap queue length, owner), then holds
# the namespace until that socket closes. It needs only the standard library and iproute2.
_BRIDGE_HELPER = r"""
import fcntl, os, socket, struct, subprocess, sys
_, run_dir, count, fd = sys.argv[1:5]
sock = socket.socket(fileno=int(fd))
def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
try:
    try:  # no IPv6 link-local chatter from the bridge or the taps on the guests' L2
        with open("/proc/sys/net/ipv6/conf/default/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass
    ip("link", "add", "br0", "type", "bridge", "stp_state", "0")
    taps = []
    for i in range(int(count)):
        tap = os.open("/dev/net/tun", os.O_RDWR)
        # TUNSETIFF with IFF_TAP | IFF_NO_PI: an Ethernet tap without packet info
        fcntl.ioctl(tap, 0x400454CA, struct.pack("16sH", b"tap%d" % i, 0x0002 | 0x1000))
        ip("link", "set", "tap%d" % i, "txqueuelen", sys.argv[5], "master", "br0", "up")
        taps.append(tap)
    ip("link", "set", "br0", "up")
    socket.send_fds(sock, [b"ok"], taps)
except Exception as exc:
    detail = getattr(exc, "stderr", "") or ""
    sock.sendall(("error: %s %s" % (exc, detail)).encode()[:4000])
    sys.exit(1)
sock.recv(1)  # returns when the harness closes its end (or dies)
"""


@dataclass(frozen=True)
class L2Counters:
    """What the guests' private L2 carried and dropped since the cluster started."""

    kind: str  # "bridge" (kernel bridge of taps) or "hub" (unix datagram fallback)
    frames: int
    dropped: int

    def describe(self) -> str:
        return f"L2 ({self.kind}): {self.frames} frames, {self.dropped} dropped"


class _Bridge:
    """The guests' private L2: taps on a kernel bridge in a network namespace of its own."""

    def __init__(self, run_dir: Path, count: int) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock = ours
        argv = [
            "unshare", "--net", "--", sys.executable, "-c", _BRIDGE_HELPER, BRIDGE_MARKER,
            str(run_dir), str(count), str(theirs.fileno()), str(TAP_QUEUE_LEN),
            f"metaroce-owner={os.getpid()}",
        ]  # fmt: skip
        try:
            self.proc = _spawn(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(theirs.fileno(),),
            )
        finally:
            theirs.close()
        ours.settimeout(30)
        try:
            msg, fds, _, _ = socket.recv_fds(ours, 4096, count)
        except OSError as exc:
            self.close()
            raise GuestError(f"the L2 bridge helper did not answer: {exc}") from exc
        if msg != b"ok" or len(fds) != count:
            for fd in fds:
                os.close(fd)
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            self.close()
            raise GuestError(f"the L2 bridge helper failed: {msg.decode()} {err}".strip())
        for fd in fds:  # only the qemu of each tap gets it (pass_fds)
            os.set_inheritable(fd, False)
        self.tap_fds = fds

    def counters(self) -> L2Counters:
        """Frames the guests sent into the bridge and every drop of the taps: a tap drops
        towards a guest whose queue of TAP_QUEUE_LEN is full, or from a guest when the
        kernel's backlog is. (The bridge's own local stack, which no guest talks to, is
        left out: it discards what it has no protocol for.)"""
        taps = self.taps()
        frames = sum(t.from_guest for t in taps.values())
        dropped = sum(t.from_guest_dropped + t.to_guest_dropped for t in taps.values())
        return L2Counters("bridge", frames, dropped)

    def taps(self) -> dict[str, TapCounts]:
        """The taps' counters, read from the helper's network namespace."""
        return tap_counts(Path(f"/proc/{self.proc.pid}/net/dev").read_text())

    def port_report(self) -> str:
        """Each tap's counters and the bridge's learned MACs: which guest stopped sending
        into the L2 or taking frames from it."""
        taps = self.taps()
        fdb = subprocess.run(
            ["nsenter", f"--net=/proc/{self.proc.pid}/ns/net", "bridge", "fdb", "show",
             "br", "br0", "dynamic"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
        lines = [f"{name}: {t.describe()}" for name, t in sorted(taps.items())]
        return "\n".join([*lines, "fdb: " + (fdb.stdout.strip() or fdb.stderr.strip())])

    def close(self) -> None:
        for fd in getattr(self, "tap_fds", []):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.tap_fds = []
        self._sock.close()
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@dataclass(frozen=True)
class TapCounts:
    """One tap of the bridge. Its receive side is what its guest sent; its transmit side
    is what went to its guest."""

    from_guest: int
    from_guest_dropped: int
    to_guest: int
    to_guest_dropped: int

    def describe(self) -> str:
        return (
            f"from guest {self.from_guest} frames ({self.from_guest_dropped} dropped), "
            f"to guest {self.to_guest} frames ({self.to_guest_dropped} dropped)"
        )


def tap_counts(proc_net_dev: str) -> dict[str, TapCounts]:
    """The taps' counters in a /proc/net/dev text, by name."""
    taps = {}
    for line in proc_net_dev.splitlines()[2:]:
        name, _, data = line.partition(":")
        fields = data.split()
        if not name.strip().startswith("tap") or len(fields) < 12:
            continue
        # receive: bytes packets errs drop ... (8 fields), transmit: bytes packets errs drop
        rx, rx_drop, tx, tx_drop = (int(fields[i]) for i in (1, 3, 9, 11))
        taps[name.strip()] = TapCounts(rx, rx_drop, tx, tx_drop)
    return taps


def _bridge_unavailable() -> str | None:
    """Why the tap bridge cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (a network namespace and taps need root)"
    if not Path("/dev/net/tun").exists():
        return "/dev/net/tun is missing (modprobe tun)"
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare (util-linux) or ip (iproute2) is not installed"
    return None


class _Hub:
    """A learning Ethernet switch between qemu ``-netdev dgram`` unix sockets."""

    def __init__(self, path: Path, ports: Sequence[Path]) -> None:
        self.path = path
        self.ports = [str(p) for p in ports]
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        # Frames go out through a second, blocking socket with a short timeout: a guest
        # whose queue is full (net.unix.max_dgram_qlen is only 10) makes the hub wait a
        # little instead of dropping the frame, as a switch with a buffer would.
        self.out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.out.settimeout(SEND_TIMEOUT)
        self.macs: dict[bytes, str] = {}
        self.frames = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="guest-l2-hub", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.sock], [], [], 0.2)
            except (OSError, ValueError):
                return
            if not ready:
                continue
            while True:
                try:
                    frame, sender = self.sock.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:
                    return
                self._forward(frame, sender if isinstance(sender, str) else "")

    def _forward(self, frame: bytes, sender: str) -> None:
        if len(frame) < 14:
            return
        self.frames += 1
        dst, src = frame[:6], frame[6:12]
        if sender and not src[0] & 1:
            self.macs[src] = sender
        port = None if dst[0] & 1 else self.macs.get(dst)
        targets = [port] if port else [p for p in self.ports if p != sender]
        for target in targets:
            try:
                self.out.sendto(frame, target)
            except OSError:  # that guest is not up (yet) or stays full: a drop
                self.dropped += 1

    def counters(self) -> L2Counters:
        return L2Counters("hub", self.frames, self.dropped)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        self.out.close()


# --- the command channel -------------------------------------------------------------


class _Pending:
    def __init__(self) -> None:
        self.event = threading.Event()
        self.reply: dict[str, Any] | None = None


class _Channel:
    """JSON lines to and from guestd over qemu's chardev socket."""

    def __init__(self, path: Path, name: str, console_log: Path) -> None:
        self.name = name
        self.console_log = console_log
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.ready = threading.Event()
        self.ready_info: dict[str, Any] = {}
        self.closed = threading.Event()
        self._pending: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._read, name=f"{name}-channel", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        self._dispatch(line)
        except OSError:
            pass
        finally:
            self.closed.set()
            with self._lock:
                for pending in self._pending.values():
                    pending.event.set()

    def _dispatch(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            log.warning("%s: unreadable line from guestd: %r", self.name, line[:200])
            return
        if msg.get("event") == "ready":
            self.ready_info = msg
            self.ready.set()
            return
        with self._lock:
            pending = self._pending.pop(msg.get("id"), None)
        if pending is not None:
            pending.reply = msg
            pending.event.set()

    def request(self, op: str, wait: float | None, **fields: Any) -> dict[str, Any]:
        if self.closed.is_set():
            raise GuestError(
                f"{self.name}: the command channel is closed (guest gone? console: "
                f"{self.console_log})"
            )
        rid = next(self._ids)
        pending = _Pending()
        with self._lock:
            self._pending[rid] = pending
        data = (json.dumps({"id": rid, "op": op, **fields}) + "\n").encode()
        try:
            with self._send_lock:
                self.sock.sendall(data)
            if not pending.event.wait(wait):
                raise GuestTimeoutError(
                    f"{self.name}: no reply to {op!r} from guestd within {wait:.0f} s "
                    f"(console: {self.console_log})"
                )
        finally:
            with self._lock:
                self._pending.pop(rid, None)
        reply = pending.reply
        if reply is None:
            raise GuestError(
                f"{self.name}: the guest closed the command channel during {op!r} "
                f"(console: {self.console_log})"
            )
        if not reply.get("ok"):
            raise GuestError(f"{self.name}: {op} failed in the guest: {reply.get('error')}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)


# --- guests --------------------------------------------------------------------------


def _to_result(guest: str, command: str | list[str], reply: Mapping[str, Any]) -> CommandResult:
    rc = reply.get("rc")
    return CommandResult(
        guest=guest,
        command=command,
        returncode=-1 if rc is None else int(rc),
        stdout=str(reply.get("stdout", "")),
        stderr=str(reply.get("stderr", "")),
        duration=float(reply.get("duration", 0.0)),
        timed_out=bool(reply.get("timed_out")),
    )


def _command(cmd: str | Sequence[str]) -> str | list[str]:
    return cmd if isinstance(cmd, str) else [str(a) for a in cmd]


class BackgroundCommand:
    """A command started with ``Guest.start``."""

    def __init__(self, guest: Guest, command: str | list[str], handle: int, pid: int) -> None:
        self.guest = guest
        self.command = command
        self.handle = handle
        self.pid = pid

    def _result(self, reply: Mapping[str, Any]) -> CommandResult:
        return _to_result(self.guest.name, self.command, reply)

    def poll(self) -> CommandResult | None:
        """The result if the command has exited, else None."""
        reply = self.guest._channel().request("wait", REPLY_MARGIN, handle=self.handle, timeout=0)
        return None if reply.get("running") else self._result(reply)

    def output(self) -> tuple[str, str]:
        """stdout and stderr so far."""
        reply = self.guest._channel().request("wait", REPLY_MARGIN, handle=self.handle, timeout=0)
        return str(reply.get("stdout", "")), str(reply.get("stderr", ""))

    def wait(self, timeout: float = 60.0, check: bool = False) -> CommandResult:
        """Wait for the command to exit; ``GuestTimeoutError`` if it is still running."""
        reply = self.guest._channel().request(
            "wait", timeout + REPLY_MARGIN, handle=self.handle, timeout=timeout
        )
        result = self._result(reply)
        if reply.get("running"):
            raise GuestTimeoutError(
                f"still running after {timeout:.0f} s:\n{result.describe()}", result
            )
        return result.check() if check else result

    def kill(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> CommandResult:
        """Signal the command's process group (SIGKILL after ``timeout``); its result."""
        reply = self.guest._channel().request(
            "kill", timeout + REPLY_MARGIN, handle=self.handle, signal=int(sig), timeout=timeout
        )
        return self._result(reply)


@dataclass
class Guest:
    """One qemu guest of a ``GuestCluster``."""

    index: int
    name: str
    ip: str
    mac: str
    console_log: Path
    qemu_log: Path
    cmd_socket: Path
    l2_socket: Path
    qmp_socket: Path
    share: Path | None
    boot_seconds: float = 0.0
    attempts: int = 0
    kernel: str = ""
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    channel: _Channel | None = field(default=None, repr=False)
    started_at: float = field(default=0.0, repr=False)

    # -- commands --
    def _channel(self) -> _Channel:
        if self.channel is None or not self.channel.ready.is_set():
            raise GuestError(f"{self.name} is not running (console: {self.console_log})")
        if self.proc is not None and self.proc.poll() is not None:
            raise GuestError(
                f"{self.name}: qemu exited with {self.proc.returncode} "
                f"(console: {self.console_log}, qemu log: {self.qemu_log})"
            )
        return self.channel

    def run(
        self,
        cmd: str | Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
    ) -> CommandResult:
        """Run a command (``bash -c`` string or argv list) and wait for it."""
        command = _command(cmd)
        reply = self._channel().request(
            "run",
            timeout + REPLY_MARGIN,
            cmd=command,
            timeout=timeout,
            env=dict(env or {}),
            cwd=cwd,
            input=input,
        )
        result = _to_result(self.name, command, reply)
        if result.timed_out:
            raise GuestTimeoutError(
                f"command timed out after {timeout:.0f} s (console: {self.console_log}):\n"
                f"{result.describe()}",
                result,
            )
        return result.check() if check else result

    def run_python(self, code: str, *args: str, **run_kw: Any) -> CommandResult:
        """Run ``python3 -c code args...`` with the guest's python3 (it has pyverbs)."""
        return self.run(["python3", "-c", code, *args], **run_kw)

    def run_python_file(self, path: str | Path, *args: str, **run_kw: Any) -> CommandResult:
        """Run a Python file of the share (a host path) with the guest's python3."""
        return self.run(["python3", self.guest_path(path), *args], **run_kw)

    def start(
        self,
        cmd: str | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        input: str | None = None,
    ) -> BackgroundCommand:
        """Start a command in the background; see ``BackgroundCommand``."""
        command = _command(cmd)
        reply = self._channel().request(
            "start", REPLY_MARGIN, cmd=command, env=dict(env or {}), cwd=cwd, input=input
        )
        return BackgroundCommand(self, command, int(reply["handle"]), int(reply["pid"]))

    def read_file(self, path: str) -> bytes:
        reply = self._channel().request("read_file", REPLY_MARGIN, path=path)
        return base64.b64decode(reply["data"])

    def write_file(self, path: str, data: bytes | str, mode: int = 0o644) -> None:
        raw = data.encode() if isinstance(data, str) else data
        self._channel().request(
            "write_file", REPLY_MARGIN, path=path, data=base64.b64encode(raw).decode(), mode=mode
        )

    def guest_path(self, host_path: str | Path) -> str:
        """Where a host path under the share is seen inside the guest."""
        if self.share is None:
            raise GuestError("this cluster has no share")
        p = Path(host_path).resolve()
        try:
            rel = p.relative_to(self.share)
        except ValueError:
            raise GuestError(f"{p} is not under the share {self.share}") from None
        return f"{GUEST_SHARE}/{rel.as_posix()}" if str(rel) != "." else GUEST_SHARE

    def tx_stalls(self) -> int:
        """How often the guest's kernel reported a NIC transmit queue stuck (NETDEV
        WATCHDOG on its console): the emulated NIC stopped sending, which no RDMA setting
        explains (seen once after 28 minutes of back-to-back RDMA streams under TCG)."""
        try:
            text = self.console_log.read_bytes().decode("utf-8", "replace")
        except OSError:
            return 0
        return text.count("NETDEV WATCHDOG")

    def nic_ring(self, ring: str) -> dict[str, Any]:
        """qemu's state of the L2 NIC's ``rx`` or ``tx`` ring (QMP's
        ``x-query-virtio-queue-status``); raises ``QmpError``."""
        where = {"path": L2_NIC_PATH, "queue": {"rx": 0, "tx": 1}[ring]}
        status: dict[str, Any] = qmp_command(self.qmp_socket, "x-query-virtio-queue-status", where)
        # the guest's own avail index, read from its memory now: what it has posted,
        # which qemu's shadow index only catches up with when it looks
        element = qmp_command(self.qmp_socket, "x-query-virtio-queue-element", where)
        status["posted"] = element["avail"]["idx"]
        return status

    def nic_queues(self) -> str:
        """What qemu holds of the L2 NIC's receive and transmit rings: how far the guest
        has posted buffers (posted, in its memory now; avail, as qemu last looked), how
        far qemu has taken them and filled them (used), and the last used index it
        interrupted the guest for (signalled). A transmit ring posted past what qemu took
        waits on qemu (or on a kick that never came); a receive ring whose buffers qemu
        has all taken waits on the guest."""
        lines = []
        for ring in ("rx", "tx"):
            try:
                st = self.nic_ring(ring)
            except QmpError as exc:
                lines.append(f"{self.name} eth0 {ring} ring: not readable over QMP: {exc}")
                continue
            lines.append(
                f"{self.name} eth0 {ring} ring (qemu's view, {st['vring-num']} slots): "
                f"posted {st['posted']}, avail {st['shadow-avail-idx']}, "
                f"taken {st['last-avail-idx']}, "
                f"used {st['used-idx']}, signalled {st['signalled-used']}, "
                f"in use {st['inuse']}"
            )
        lines.append(self._nic_state())
        return "\n".join(lines)

    def _nic_state(self) -> str:
        """The L2 NIC's device state as qemu holds it (broken after a virtio error, the
        driver's status bits) and its receive filter (what it would drop unread)."""
        try:
            dev = qmp_command(self.qmp_socket, "x-query-virtio-status", {"path": L2_NIC_PATH})
            filters = qmp_command(self.qmp_socket, "query-rx-filter", {"name": L2_NIC_ID})
        except QmpError as exc:
            return f"{self.name} eth0 device: not readable over QMP: {exc}"
        status = [s.split(":")[0].removeprefix("VIRTIO_CONFIG_S_") for s in
                  dev.get("status", {}).get("statuses", [])]  # fmt: skip
        f = filters[0] if filters else {}
        return (
            f"{self.name} eth0 device: broken {dev.get('broken')}, status {'|'.join(status)}, "
            f"vm running {dev.get('vm-running')}; rx filter: promiscuous "
            f"{f.get('promiscuous')}, unicast {f.get('unicast')}, multicast "
            f"{f.get('multicast')}, main mac {f.get('main-mac')}"
        )

    def console_tail(self, lines: int = 25) -> str:
        try:
            text = self.console_log.read_bytes().decode("utf-8", "replace")
        except OSError:
            return "(no console output)"
        return "\n".join(text.splitlines()[-lines:])


# --- clusters ------------------------------------------------------------------------

_live: weakref.WeakSet[GuestCluster] = weakref.WeakSet()
# Every successful boot of this process: (guest count, seconds for the cluster,
# seconds per guest, boot attempts per guest). Test runs print it in their summary.
boot_history: list[tuple[int, float, list[float], list[int]]] = []
_signals_installed: dict[int, Any] = {}


def _close_all() -> None:
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.close()


atexit.register(_close_all)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # Unwind the stack as Ctrl-C does, closing clusters on the way out (pytest, too,
    # stops the session and runs its teardowns on KeyboardInterrupt).
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """Hold off SIGINT/SIGTERM/SIGHUP while cleaning up: a second signal (a second Ctrl-C,
    or `timeout`, which signals the child and then its whole process group) must not
    cut a cleanup short. The stop is already under way, so held signals are dropped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[signal.Signals, Any] = {}
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        with contextlib.suppress(ValueError, OSError):
            previous[sig] = signal.signal(sig, lambda signum, frame: None)
    try:
        yield
    finally:
        for held, handler in previous.items():
            with contextlib.suppress(ValueError, OSError, TypeError):
                signal.signal(held, handler)


def _install_signal_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if sig in _signals_installed:
            continue
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) is signal.SIG_DFL:
                _signals_installed[sig] = signal.signal(sig, _on_signal)


def _restore_signal_handlers() -> None:
    if _live or threading.current_thread() is not threading.main_thread():
        return
    for sig, previous in list(_signals_installed.items()):
        with contextlib.suppress(ValueError, OSError):
            if signal.getsignal(sig) is _on_signal:
                signal.signal(sig, previous)
        del _signals_installed[sig]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale_run_dirs() -> None:
    """Remove run directories whose owner died without cleaning up (e.g. SIGKILL)."""
    for d in RUN_DIR_PARENT.glob(RUN_DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            if time.time() - d.stat().st_mtime < 60:
                continue  # being created right now
            owner = -1
        if owner <= 0 or not _pid_alive(owner):
            shutil.rmtree(d, ignore_errors=True)


def leftovers(owner_pid: int | None = None) -> list[str]:
    """qemu processes, L2 bridge helpers and run directories of the harness (of
    ``owner_pid`` if given)."""
    found: list[str] = []
    dirs = []
    for d in RUN_DIR_PARENT.glob(RUN_DIR_PREFIX + "*"):
        try:
            owner = int((d / "owner.pid").read_text().strip())
        except (OSError, ValueError):
            owner = -1
        if owner_pid is None or owner == owner_pid:
            dirs.append(d)
            found.append(f"run directory {d} (owner pid {owner})")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        helper = BRIDGE_MARKER.encode() in argv
        if not argv or (b"qemu-system" not in argv[0] and not helper):
            continue
        line = b" ".join(argv).decode("utf-8", "replace")
        if RUN_DIR_PREFIX not in line:
            continue
        if owner_pid is not None and not any(str(d) in line for d in dirs):
            # a qemu of ours whose run directory is already gone is a leak too
            marker = f"metaroce-owner={owner_pid}"
            if marker not in line:
                continue
        if helper:  # its argv starts with the helper's script: show what follows it
            line = line[line.find(BRIDGE_MARKER) :]
        found.append(
            f"{'L2 bridge helper' if helper else 'qemu'} pid {proc.name}: {_short(line, 200)}"
        )
    return found


def clock_is_wrong(uptime: float, host_seconds: float) -> str | None:
    """Why a guest's clock is wrong, or None, from its uptime once it is up and the
    host's seconds since it started qemu. The guest cannot have been up longer than
    the host waited (5% and a second cover the two reading points), nor booted in a
    fifth of it (qemu starts in under 2 s; kernel, /init and guestd take 4 s of the
    guest's own time). A kernel whose TSC calibration against the emulated PIT goes
    wrong on a busy host (seen once: its clock ran 18x fast) keeps the wrong rate, as
    `tsc=reliable` turns off the watchdog that would catch it, and its timeouts,
    sleeps and qdisc rates then mean nothing."""
    if uptime > host_seconds * 1.05 + 1.0:
        how = "fast"
    elif uptime < (host_seconds - 2.0) / 5:
        how = "slow"
    else:
        return None
    return (
        f"guest clock runs {how}, {uptime / max(host_seconds, 0.1):.2f}x the host's (uptime "
        f"{uptime:.1f} s after {host_seconds:.1f} s of host time): a TSC miscalibrated at boot"
    )


def _default_log_root() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "metaroce" / "guest-logs"


def _prune_logs(root: Path) -> None:
    runs = sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
    for d in runs[:-KEEP_LOG_RUNS]:
        shutil.rmtree(d, ignore_errors=True)


class GuestCluster:
    """N qemu guests on one private L2; see the module docstring."""

    def __init__(
        self,
        count: int = 2,
        *,
        memory_mb: int = 1024,
        cpus: int = 1,
        share: Path | str | None = REPO_ROOT,
        image: GuestImage | None = None,
        boot_timeout: float = 120.0,
        boot_attempts: int = 2,
        log_dir: Path | str | None = None,
        kernel_args: str = "",
        qemu: str | None = None,
        shares: Mapping[str, Path | str] | None = None,
        host_forwards: Callable[[int], Sequence[str]] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError("count must be at least 1")
        if count > 200:
            raise ValueError("count must be at most 200 (addresses 192.168.77.11-210)")
        self.count = count
        self.memory_mb = memory_mb
        self.cpus = cpus
        self.share = Path(share).resolve() if share is not None else None
        self.image = image
        self.boot_timeout = boot_timeout
        self.boot_attempts = max(1, boot_attempts)
        self.kernel_args = kernel_args
        self.qemu = qemu or "qemu-system-x86_64"
        # Extra read-only 9p shares: guest path -> host directory.
        self.shares = {k: Path(v).resolve() for k, v in (shares or {}).items()}
        for guest_path, host_dir in self.shares.items():
            if not guest_path.startswith("/") or " " in guest_path or "," in guest_path:
                raise ValueError(
                    f"shares: guest path {guest_path!r} must be absolute, without spaces or commas"
                )
            if not host_dir.is_dir():
                raise ValueError(f"shares[{guest_path!r}]: {host_dir} is not a directory")
        # qemu user-net hostfwd rules per guest index, e.g. "tcp:127.0.0.1:8080-:80".
        self.host_forwards = host_forwards
        self._log_dir_arg = Path(log_dir) if log_dir is not None else None
        self.log_dir: Path | None = None
        self.run_dir: Path | None = None
        self.guests: list[Guest] = []
        self.boot_seconds = 0.0
        self._l2: _Bridge | _Hub | None = None
        self._closed = False
        self._started = False

    # -- container protocol --
    def __len__(self) -> int:
        return len(self.guests)

    def __getitem__(self, i: int) -> Guest:
        return self.guests[i]

    def __iter__(self) -> Iterator[Guest]:
        return iter(self.guests)

    def __enter__(self) -> GuestCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- lifecycle --
    def start(self) -> GuestCluster:
        if self._started:
            raise GuestError("this cluster was started already")
        self._started = True
        _live.add(self)
        _install_signal_handlers()
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        t0 = time.monotonic()
        qemu = shutil.which(self.qemu)
        if qemu is None:
            raise GuestBootError(
                f"{self.qemu} is not installed: run {BUILD_SCRIPT} (it installs "
                "qemu-system-x86) or apt-get install qemu-system-x86"
            )
        self.qemu = qemu
        if self.image is None:
            self.image = find_image()
        _sweep_stale_run_dirs()
        self.run_dir = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=RUN_DIR_PARENT))
        (self.run_dir / "owner.pid").write_text(f"{os.getpid()}\n")
        log_root = self._log_dir_arg or _default_log_root()
        log_root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            _prune_logs(log_root)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = log_root / f"{stamp}-{os.getpid()}-{self.run_dir.name[-8:]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)

        for i in range(self.count):
            n = i + 1
            self.guests.append(
                Guest(
                    index=i,
                    name=f"node-{n}",
                    ip=guest_ip(i),
                    mac=f"52:54:00:77:{n >> 8:02x}:{n & 0xFF:02x}",
                    console_log=self.log_dir / f"node-{n}.console.log",
                    qemu_log=self.log_dir / f"node-{n}.qemu.log",
                    cmd_socket=self.run_dir / f"n{n}.cmd",
                    l2_socket=self.run_dir / f"n{n}.l2",
                    qmp_socket=self.run_dir / f"n{n}.qmp",
                    share=self.share,
                )
            )
        self._l2 = self._make_l2()
        log.info(
            "booting %d guest(s) (%d MiB, %d vCPU each, TCG), logs in %s",
            self.count,
            self.memory_mb,
            self.cpus,
            self.log_dir,
        )
        for g in self.guests:
            self._launch(g)
        self._wait_for_boot()
        self.boot_seconds = time.monotonic() - t0
        boot_history.append(
            (
                self.count,
                self.boot_seconds,
                [g.boot_seconds for g in self.guests],
                [g.attempts for g in self.guests],
            )
        )
        log.info(
            "%d guest(s) up in %.1f s (%s)",
            self.count,
            self.boot_seconds,
            ", ".join(f"{g.name} {g.boot_seconds:.1f} s" for g in self.guests),
        )

    def _make_l2(self) -> _Bridge | _Hub:
        assert self.run_dir is not None
        why = _bridge_unavailable()
        if why is None:
            try:
                return _Bridge(self.run_dir, self.count)
            except GuestError as exc:
                why = str(exc)
        log.warning(
            "the guests' L2 is the unix-datagram hub, not the lossless tap bridge: %s; "
            "RDMA over it may stall on dropped frames (l2_counters() counts them)",
            why,
        )
        return _Hub(self.run_dir / "hub.l2", [g.l2_socket for g in self.guests])

    def l2_counters(self) -> L2Counters:
        """Frames and drops of the guests' private L2 since the cluster started."""
        if self._l2 is None:
            raise GuestError("the cluster is not running")
        return self._l2.counters()

    def l2_report(self) -> str:
        """The guests' L2 as it is now, for a failed test: the bridge's ports, and each
        guest's NIC counters, neighbours, qdiscs, a ping of every other guest over the L2
        and the kernel's last words. Gathered over the guests' command channel, which does
        not ride the L2, so it still answers when the L2 is dead."""
        parts: list[str] = []
        if isinstance(self._l2, _Bridge):
            try:
                parts.append(self._l2.port_report())
            except (OSError, subprocess.SubprocessError) as exc:
                parts.append(f"bridge: not readable: {exc}")
        elif self._l2 is not None:
            parts.append(self._l2.counters().describe())
        for g in self.guests:
            peers = " ".join(o.ip for o in self.guests if o is not g)
            script = (
                "ip -s link show dev eth0; ip neigh show dev eth0; tc -s qdisc show dev eth0; "
                "{ ethtool -S eth0 | grep -v ': 0$'; } 2>/dev/null; "
                # the NIC's interrupts and the softirq's per-CPU counts: does the guest
                # still hear from the NIC, and does its receive softirq still run?
                'v=$(basename "$(readlink /sys/class/net/eth0/device)"); '
                'grep "$v-" /proc/interrupts; echo softnet_stat:; cat /proc/net/softnet_stat; '
                f"for p in {peers}; do ping -n -q -c 2 -W 1 -I eth0 $p | tail -n 2; done; "
                "dmesg | tail -n 12"
            )
            try:
                out = g.run(script, timeout=30)
                parts.append(f"--- {g.name} ---\n{out.stdout.strip()}\n{out.stderr.strip()}")
            except GuestError as exc:
                parts.append(f"--- {g.name}: no answer: {exc}")
            parts.append(g.nic_queues())
        return "\n".join(parts)

    def _l2_netdev(self, g: Guest) -> str:
        if isinstance(self._l2, _Bridge):
            return f"tap,id={L2_NETDEV_ID},fd={self._l2.tap_fds[g.index]}"
        assert self.run_dir is not None
        return (
            f"dgram,id={L2_NETDEV_ID},local.type=unix,local.path={g.l2_socket},"
            f"remote.type=unix,remote.path={self.run_dir / 'hub.l2'}"
        )

    def _qemu_argv(self, g: Guest) -> list[str]:
        assert self.image is not None and self.run_dir is not None
        n = g.index + 1
        env_path = [f"{GUEST_SHARE}/{d}" for d in PACKAGE_DIRS] if self.share else []
        env_path.append(GUEST_PYTHON_DIR)
        forwards = self.host_forwards(g.index) if self.host_forwards else ()
        hostfwd = [f"hostfwd={rule}" for rule in forwards]
        cmdline = [
            DEFAULT_KERNEL_ARGS,
            f"metaroce.hostname={g.name}",
            f"metaroce.nodes={self.count}",
            f"metaroce.nic=eth0,{g.mac},{g.ip}/24",
            f"metaroce.nic=eth1,52:54:00:02:{n >> 8:02x}:{n & 0xFF:02x},10.0.2.15/24,10.0.2.2",
            f"metaroce.mount=gpy,{GUEST_PYTHON_DIR}",
            *([f"metaroce.mount=share,{GUEST_SHARE}"] if self.share is not None else []),
            *(f"metaroce.mount=x{i},{p}" for i, p in enumerate(self.shares)),
            f"metaroce.env=PYTHONPATH={':'.join(env_path)}",
            f"metaroce.env=METAROCE_NODE={g.name}",
            f"metaroce-owner={os.getpid()}",
        ]
        if self.kernel_args:
            cmdline.append(self.kernel_args)
        # event_idx=off: with virtio's event index, a guest sending flat out (ib_write_bw
        # over rxe) lost a transmit kick every few minutes under TCG: qemu's avail_event
        # stayed behind the guest's avail index, qemu waited for a kick that never came and
        # the L2 was dead one way (a manual kick revived it). The used ring's no-notify
        # flag has not lost one since (l2_health's docstring has the figures).
        l2_nic = (
            f"virtio-net-pci,netdev={L2_NETDEV_ID},id={L2_NIC_ID},mac={g.mac},romfile=,"
            "event_idx=off"
        )
        argv = [
            self.qemu,
            "-name", f"{g.name},process=metaroce-{g.name}",
            "-machine", "pc",
            "-accel", "tcg,thread=multi",
            "-cpu", "max",
            "-smp", str(self.cpus),
            "-m", str(self.memory_mb),
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", str(self.image.vmlinux),
            "-initrd", str(self.image.initramfs),
            "-append", " ".join(cmdline),
            "-serial", f"file:{g.console_log}",
            "-device", "virtio-rng-pci",
            "-netdev", self._l2_netdev(g),
            "-device", l2_nic,
            "-netdev", ",".join(["user,id=wan,net=10.0.2.0/24", *hostfwd]),
            "-device",
            f"virtio-net-pci,netdev=wan,mac=52:54:00:02:{n >> 8:02x}:{n & 0xFF:02x},romfile=",
            "-virtfs",
            f"local,path={self.image.guest_python},mount_tag=gpy,security_model=none,"
            "readonly=on,multidevs=remap",
            "-virtfs",
            f"local,path={self.image.rootfs},mount_tag=root,security_model=none,"
            "readonly=on,multidevs=remap",
            "-device", "virtio-serial-pci,id=vser",
            "-chardev", f"socket,id=cmd,path={g.cmd_socket},server=on,wait=off",
            "-device", f"virtserialport,bus=vser.0,chardev=cmd,name={CMD_PORT_NAME}",
            "-qmp", f"unix:{g.qmp_socket},server=on,wait=off",
        ]  # fmt: skip
        if _QBOOT.exists():  # a minimal firmware: boots much faster than SeaBIOS under TCG
            argv += ["-bios", str(_QBOOT)]
        if self.share is not None:
            argv += [
                "-virtfs",
                f"local,path={self.share},mount_tag=share,security_model=none,"
                "readonly=on,multidevs=remap",
            ]
        for i, host_dir in enumerate(self.shares.values()):
            argv += [
                "-virtfs",
                f"local,path={host_dir},mount_tag=x{i},security_model=none,"
                "readonly=on,multidevs=remap",
            ]
        return argv

    def _launch(self, g: Guest) -> None:
        g.attempts += 1
        for path in (g.cmd_socket, g.l2_socket, g.qmp_socket):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        if g.console_log.exists():  # keep the console of the failed attempt
            g.console_log.rename(g.console_log.with_suffix(f".attempt{g.attempts - 1}.log"))
        argv = self._qemu_argv(g)
        with open(g.qemu_log, "ab") as qlog:
            qlog.write(f"# attempt {g.attempts}: {shlex.join(argv)}\n".encode())
            qlog.flush()
            fds = (self._l2.tap_fds[g.index],) if isinstance(self._l2, _Bridge) else ()
            g.proc = _spawn(argv, stdin=subprocess.DEVNULL, stdout=qlog, stderr=qlog, pass_fds=fds)
        g.started_at = time.monotonic()
        log.info("%s: qemu pid %d (attempt %d)", g.name, g.proc.pid, g.attempts)

    def _kill(self, g: Guest) -> None:
        if g.channel is not None:
            g.channel.close()
            g.channel = None
        proc = g.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)

    def _boot_failure(self, g: Guest, why: str) -> None:
        """Retry a failed boot if attempts remain, else raise."""
        self._kill(g)
        if g.attempts < self.boot_attempts:
            log.warning(
                "%s: %s (console: %s); booting it again (attempt %d of %d)",
                g.name,
                why,
                g.console_log,
                g.attempts + 1,
                self.boot_attempts,
            )
            self._launch(g)
            return
        raise GuestBootError(
            f"{g.name}: {why} after {g.attempts} attempt(s)\n"
            f"console log: {g.console_log}\nqemu log: {g.qemu_log}\n"
            f"--- console tail ---\n{g.console_tail()}"
        )

    @staticmethod
    def _tsc_lines(g: Guest, rate: float) -> str:
        """The guest kernel's TSC calibration lines, for the log of a bad clock. guestd
        times the command by the guest's clock, which runs `rate` times the host's: the
        timeout is scaled so that it means 20 s of the host's (once it meant 0.8 s)."""
        try:
            out = g.run(
                "dmesg | grep -E 'tsc: |Switched to clocksource'", timeout=20 * max(rate, 1.0)
            ).stdout
        except (GuestError, OSError) as e:
            return f"; the guest's dmesg could not be read: {_short(str(e), 200)}"
        return "; the guest's kernel said:\n" + out.strip() if out.strip() else ""

    def _wait_for_boot(self) -> None:
        pending = list(self.guests)
        last_note = time.monotonic()
        while pending:
            for g in list(pending):
                assert g.proc is not None
                if g.channel is None and g.cmd_socket.exists():
                    with contextlib.suppress(OSError):
                        g.channel = _Channel(g.cmd_socket, g.name, g.console_log)
                if g.channel is not None and g.channel.ready.is_set():
                    info = g.channel.ready_info
                    errors = info.get("init_errors") or []
                    if errors:
                        raise GuestBootError(
                            f"{g.name}: the guest's /init reported errors: {errors}\n"
                            f"console log: {g.console_log}"
                        )
                    g.boot_seconds = time.monotonic() - g.started_at
                    g.kernel = str(info.get("kernel", ""))
                    uptime = float(info.get("uptime", 0.0))
                    log.info(
                        "%s: up in %.1f s (guest uptime %.1f s, kernel %s)",
                        g.name,
                        g.boot_seconds,
                        uptime,
                        g.kernel,
                    )
                    bad_clock = clock_is_wrong(uptime, g.boot_seconds)
                    if bad_clock:
                        rate = uptime / max(g.boot_seconds, 0.1)
                        self._boot_failure(g, f"{bad_clock}{self._tsc_lines(g, rate)}")
                        continue
                    pending.remove(g)
                elif g.proc.poll() is not None:
                    self._boot_failure(g, f"qemu exited with {g.proc.returncode} while booting")
                elif time.monotonic() - g.started_at > self.boot_timeout:
                    self._boot_failure(g, f"boot watchdog: not up within {self.boot_timeout:.0f} s")
            if pending and time.monotonic() - last_note > 10:
                last_note = time.monotonic()
                log.info(
                    "still booting: %s",
                    ", ".join(
                        f"{g.name} ({time.monotonic() - g.started_at:.0f} s)" for g in pending
                    ),
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every guest and remove the run directory. Idempotent."""
        if self._closed:
            return
        with _signals_held():
            try:
                for g in self.guests:
                    with contextlib.suppress(Exception):
                        self._kill(g)
                if self._l2 is not None:
                    self._l2.close()
                    self._l2 = None
            finally:
                if self.run_dir is not None:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                self._closed = True
                _live.discard(self)
        _restore_signal_handlers()
        if self.guests:
            log.info("guests stopped; console logs kept in %s", self.log_dir)

    # -- helpers --
    def run_all(self, cmd: str | Sequence[str], **run_kw: Any) -> list[CommandResult]:
        """Run one command on every guest in parallel; results in guest order."""
        with ThreadPoolExecutor(max_workers=len(self.guests)) as pool:
            futures = [pool.submit(g.run, cmd, **run_kw) for g in self.guests]
            return [f.result() for f in futures]

    def describe(self) -> str:
        lines = []
        for g in self.guests:
            lines.append(
                f"  {g.name}: eth0 {g.ip}/24, eth1 10.0.2.15 (host at 10.0.2.2), "
                f"booted in {g.boot_seconds:.1f} s, console {g.console_log}"
            )
        return "\n".join(lines)


# --- command line --------------------------------------------------------------------

CURRENT_FILE = RUN_DIR_PARENT / "metaroce-guests.current"


class _ControlHandler(socketserver.StreamRequestHandler):
    cluster: GuestCluster

    def handle(self) -> None:
        try:
            req = json.loads(self.rfile.readline())
            node = int(req["node"])
            guest = self.cluster[node - 1]
            result = guest.run(req["cmd"], timeout=float(req.get("timeout", 600)))
            reply: dict[str, Any] = {
                "rc": result.returncode,
                "stdout": result.stdout,
                "stderr": result.stderr,
            }
        except GuestTimeoutError as exc:
            reply = {"rc": 124, "stdout": "", "stderr": f"{exc}\n"}
        except Exception as exc:
            reply = {"rc": 125, "stdout": "", "stderr": f"{type(exc).__name__}: {exc}\n"}
        self.wfile.write((json.dumps(reply) + "\n").encode())


def _cmd_up(args: argparse.Namespace) -> int:
    share = None if args.no_share else REPO_ROOT
    # Ctrl-C must stop the guests even when started from a shell that ignores SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with GuestCluster(
        count=args.count, memory_mb=args.memory_mb, cpus=args.cpus, share=share
    ) as cluster:
        assert cluster.run_dir is not None
        control = cluster.run_dir / "control.sock"
        handler = type("Handler", (_ControlHandler,), {"cluster": cluster})
        server = socketserver.ThreadingUnixStreamServer(str(control), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        CURRENT_FILE.write_text(str(control) + "\n")
        me = f"{sys.executable} -m metaroce_harness.guests"
        print(f"{len(cluster)} guest(s) up in {cluster.boot_seconds:.1f} s:", flush=True)
        print(cluster.describe())
        print(
            f"\nrun a command:   {me} run --node 1 -- rdma link\n"
            f"                 {me} run --node 2 -- 'modprobe rdma_rxe && rdma link add rxe0 "
            "type rxe netdev eth0'\n"
            f"the repo is at {GUEST_SHARE} in the guests (read-only)\n"
            "stop:            Ctrl-C",
            flush=True,
        )
        try:
            while all(g.proc is not None and g.proc.poll() is None for g in cluster):
                time.sleep(1)
            print("a guest stopped; shutting down", file=sys.stderr)
        except KeyboardInterrupt:
            print("\nstopping guests", file=sys.stderr)
        finally:
            server.shutdown()
            server.server_close()
            with contextlib.suppress(OSError):
                if CURRENT_FILE.read_text().strip() == str(control):
                    CURRENT_FILE.unlink()
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    control = Path(args.control) if args.control else None
    if control is None:
        try:
            control = Path(CURRENT_FILE.read_text().strip())
        except OSError:
            print(
                "no running guests: start them with `python -m metaroce_harness.guests up`",
                file=sys.stderr,
            )
            return 2
    cmd = args.command
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("no command given", file=sys.stderr)
        return 2
    command: str | list[str] = cmd[0] if len(cmd) == 1 else cmd
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(control))
        req = {"node": args.node, "cmd": command, "timeout": args.timeout}
        s.sendall((json.dumps(req) + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    reply = json.loads(data)
    sys.stdout.write(reply["stdout"])
    sys.stderr.write(reply["stderr"])
    return int(reply["rc"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m metaroce_harness.guests", description="SoftRoCE qemu test guests"
    )
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="boot guests and keep them up until Ctrl-C")
    up.add_argument("--count", type=int, default=2)
    up.add_argument("--memory-mb", type=int, default=1024)
    up.add_argument("--cpus", type=int, default=1)
    up.add_argument("--no-share", action="store_true", help="do not share the repo")
    run = sub.add_parser("run", help="run a command in a guest of a running `up`")
    run.add_argument("--node", type=int, default=1, help="guest number (node-N), from 1")
    run.add_argument("--timeout", type=float, default=600.0)
    run.add_argument("--control", help="control socket (default: the last `up`)")
    run.add_argument("command", nargs=argparse.REMAINDER)
    sub.add_parser("build", help="build (or reuse) the guest image and print its directory")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[guests] %(message)s")
    try:
        if args.action == "up":
            return _cmd_up(args)
        if args.action == "run":
            return _cmd_run(args)
        print(find_image().root)
        return 0
    except GuestError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
