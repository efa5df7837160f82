"""The MetaRoCE transport's stats files: per-allocation directories, read safely, per pod.

The transport library, given `stats_dir=DIR` in `MR_CONFIG`, writes one JSON file per
endpoint, `DIR/ep-<pid>-<port>.json` (schema `metaroce.io/stats/v1`, see
transport/crates/metaroce/src/stats.rs), every second and at close, through a temporary
name and a rename.

Where the files are
-------------------
`Allocate` of a metaroce unit creates a fresh directory for that one container,
`<state dir>/<network>/stats/<allocation id>` on the host (`StatsDirectories.create`),
and mounts it read-write at `STATS_CONTAINER_DIR`. The parent (`stats/`) is root-owned
0700 and mounted nowhere, so a pod reaches only its own directory; the directory itself is
0777 because the device plugin cannot know the container's user (or its user
namespace). Which units each allocation was made for is recorded in a root-only file
beside it (`RECORD_FILE`), never in the pod-writable directory.

Reading them
------------
Everything in the directory is the pod's to forge, so the agent trusts none of it: it
opens the directory and each `ep-*.json` relative to it with `O_NOFOLLOW` (a symlink is
refused, not followed into the host) and `O_NONBLOCK` (a FIFO cannot hang the scrape),
refuses what `fstat` says is not a regular file, reads at most `MAX_FILE_BYTES`, looks at
the newest `MAX_FILES` files of a directory only, and validates the schema and every
field's type. A refused file is counted by reason
(`metaroce_transport_stats_files_refused_total`) and never fails a scrape.

Whose they are
--------------
The kubelet does not tell `Allocate` which pod it serves; its PodResources API (`List`)
says which container holds which units. An allocation belongs to the container holding
all its units; when several allocations were made for the same units (a unit freed and
handed to a new pod), the newest is that container's, the older ones are stale. A
directory no container holds is removed after `GRACE_SECONDS` (the kubelet lists a pod
a moment after `Allocate`, and a container restart re-uses its directory).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import secrets
import shutil
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from metaroce_agent.host import Host, HostError

log = logging.getLogger("metaroce.agent.stats")

SCHEMA = "metaroce.io/stats/v1"
STATS_CONTAINER_DIR = "/run/metaroce-stats"
"""Where a container sees its allocation's stats directory (read-write)."""
STATS_ENV = "MR_STATS_DIR"
"""Names `STATS_CONTAINER_DIR` for a job that sets its own `MR_CONFIG`: it appends
`stats_dir=$MR_STATS_DIR` to keep its counters exported."""
RECORD_FILE = "metaroce-stats.json"
"""In the agent's state directory of the network: `{allocation id: {units, created}}`."""
MAX_FILE_BYTES = 256 << 10
"""The library's files stay under 100 KiB (32 peers x 16 paths); larger is not its."""
MAX_FILES = 64
"""Endpoint files read per allocation (more are refused as `too-many`)."""
GRACE_SECONDS = 300.0
FILE_RE = re.compile(r"ep-[0-9]{1,10}-[0-9]{1,5}\.json")
STALE_SECONDS = 5.0
"""A snapshot older than this (its process died without closing) adds no goodput."""
REFUSE_REASONS = (
    "symlink",
    "not-regular",
    "oversize",
    "unreadable",
    "bad-json",
    "bad-schema",
    "too-many",
)


class StatsFileError(ValueError):
    """A stats file the agent refuses; `reason` is one of `REFUSE_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


# --- one file -------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathFigures:
    """One path of one peer (what the exporter aggregates)."""

    failed: bool
    cwnd: int
    srtt_us: int
    min_rtt_us: int


@dataclass(frozen=True)
class EndpointStats:
    """One endpoint's snapshot, validated."""

    pid: int
    unix_ms: int
    closed: bool
    counters: Mapping[str, int]
    io: Mapping[str, int]
    paths: tuple[PathFigures, ...]


def _uint(obj: Mapping[str, Any], key: str, where: str) -> int:
    v = obj.get(key)
    # bool is an int in Python; JSON true is not a counter
    if not isinstance(v, int) or isinstance(v, bool) or v < 0 or v >= 1 << 64:
        raise StatsFileError("bad-schema", f"{where}.{key} is {v!r}, not an unsigned integer")
    return v


def _uint_map(obj: Any, where: str) -> dict[str, int]:
    if not isinstance(obj, dict):
        raise StatsFileError("bad-schema", f"{where} is not an object")
    out = {}
    for k in obj:
        if not isinstance(k, str) or not re.fullmatch(r"[a-z][a-z0-9_]{0,63}", k):
            raise StatsFileError("bad-schema", f"{where} has a key {k!r} that is not a name")
        out[k] = _uint(obj, k, where)
    return out


def parse_snapshot(data: bytes) -> EndpointStats:
    """A stats file's content, validated against `metaroce.io/stats/v1`."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise StatsFileError("bad-json", str(e)[:200]) from e
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise StatsFileError("bad-schema", f"schema is {got!r}, not {SCHEMA}")
    closed = doc.get("closed")
    if not isinstance(closed, bool):
        raise StatsFileError("bad-schema", f"closed is {closed!r}, not a boolean")
    peers = doc.get("peers")
    if not isinstance(peers, list):
        raise StatsFileError("bad-schema", "peers is not a list")
    paths = []
    for i, peer in enumerate(peers):
        peer_paths = peer.get("paths") if isinstance(peer, dict) else None
        if not isinstance(peer_paths, list):
            raise StatsFileError("bad-schema", f"peers[{i}].paths is not a list")
        for j, p in enumerate(peer_paths):
            where = f"peers[{i}].paths[{j}]"
            if not isinstance(p, dict) or not isinstance(p.get("failed"), bool):
                raise StatsFileError("bad-schema", f"{where}.failed is not a boolean")
            paths.append(
                PathFigures(
                    failed=p["failed"],
                    cwnd=_uint(p, "cwnd", where),
                    srtt_us=_uint(p, "srtt_us", where),
                    min_rtt_us=_uint(p, "min_rtt_us", where),
                )
            )
    return EndpointStats(
        pid=_uint(doc, "pid", "file"),
        unix_ms=_uint(doc, "unix_ms", "file"),
        closed=closed,
        counters=_uint_map(doc.get("counters"), "counters"),
        io=_uint_map(doc.get("io"), "io"),
        paths=tuple(paths),
    )


def read_bounded(dir_fd: int, name: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """The content of `name` in the directory `dir_fd`, refusing a symlink, anything but a
    regular file, and more than `limit` bytes (`StatsFileError`)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StatsFileError("symlink", f"{name} is a symlink") from e
        raise StatsFileError("unreadable", f"{name}: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StatsFileError("not-regular", f"{name} is not a regular file")
        if st.st_size > limit:
            raise StatsFileError("oversize", f"{name} has {st.st_size} bytes (limit {limit})")
        chunks = []
        left = limit + 1  # one more, to see a file that grew after fstat
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 10))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise StatsFileError("oversize", f"{name} grew past {limit} bytes")
        return data
    except OSError as e:
        raise StatsFileError("unreadable", f"{name}: {e.strerror}") from e
    finally:
        os.close(fd)


def read_directory(
    path: str, max_files: int = MAX_FILES
) -> tuple[dict[str, EndpointStats], Counter[str]]:
    """Every endpoint file of one allocation directory (a real path), and the refusals by
    reason. The directory itself is opened with O_NOFOLLOW; a missing one is empty."""
    refused: Counter[str] = Counter()
    out: dict[str, EndpointStats] = {}
    try:
        dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return out, refused
    except OSError as e:
        refused["symlink" if e.errno in (errno.ELOOP, errno.ENOTDIR) else "unreadable"] += 1
        return out, refused
    try:
        with os.scandir(dfd) as it:
            entries = [
                (e.stat(follow_symlinks=False).st_mtime_ns, e.name)
                for e in it
                if FILE_RE.fullmatch(e.name)
            ]
        # the newest files when there are too many: a live endpoint rewrites its file
        # every second, so those of closed endpoints are the ones left out
        entries.sort(reverse=True)
        if len(entries) > max_files:
            refused["too-many"] += len(entries) - max_files
            del entries[max_files:]
        names = sorted(name for _, name in entries)
        for name in names:
            try:
                out[name] = parse_snapshot(read_bounded(dfd, name))
            except StatsFileError as e:
                refused[e.reason] += 1
                log.debug("stats file %s/%s refused: %s", path, name, e)
    finally:
        os.close(dfd)
    return out, refused


# --- whose allocation is it ------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class ContainerRef:
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True)
class AllocationRecord:
    units: frozenset[str]
    created: float


@dataclass(frozen=True)
class Attribution:
    owners: dict[str, ContainerRef] = field(default_factory=dict)
    """Allocation id -> the container it belongs to."""
    unowned: tuple[str, ...] = ()
    """Allocations no container holds now (or superseded by a newer one)."""


def attribute(
    records: Mapping[str, AllocationRecord], holders: Mapping[ContainerRef, frozenset[str]]
) -> Attribution:
    """Which container each allocation belongs to (pure; see the module's docstring)."""
    owners: dict[str, ContainerRef] = {}
    for ref, units in holders.items():
        mine = [a for a, r in records.items() if r.units and r.units <= units]
        if mine:
            newest = max(mine, key=lambda a: (records[a].created, a))
            owners[newest] = ref
    return Attribution(owners, tuple(sorted(a for a in records if a not in owners)))


# --- the directories on the host ---------------------------------------------------------


class StatsDirectories:
    """The network's per-allocation stats directories and their record (thread-safe:
    `create` runs in the device plugin's gRPC threads, the rest in the agent's)."""

    def __init__(
        self,
        host: Host,
        state_dir: str,
        network: str,
        clock: Callable[[], float] = time.time,
        grace: float = GRACE_SECONDS,
    ) -> None:
        self.host = host
        self.root = f"{state_dir}/{network}/stats"
        self.record_path = f"{state_dir}/{network}/{RECORD_FILE}"
        self.clock = clock
        self.grace = grace
        self._lock = threading.Lock()
        self._unowned_since: dict[str, float] = {}

    def host_dir(self, allocation: str) -> str:
        return f"{self.root}/{allocation}"

    def records(self) -> dict[str, AllocationRecord]:
        text = self.host.read_opt(self.record_path)
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            log.warning("%s is not JSON: stats allocations start afresh", self.record_path)
            data = {}
        out = {}
        for k, v in (data if isinstance(data, dict) else {}).items():
            if isinstance(v, dict) and isinstance(v.get("units"), list):
                created = v.get("created")
                out[str(k)] = AllocationRecord(
                    frozenset(str(u) for u in v["units"]),
                    float(created) if isinstance(created, int | float) else 0.0,
                )
        return out

    def _save(self, records: Mapping[str, AllocationRecord]) -> None:
        doc = {a: {"units": sorted(r.units), "created": r.created} for a, r in records.items()}
        self.host.write_atomic(self.record_path, json.dumps(doc, sort_keys=True, indent=1))

    def create(self, units: Iterable[str]) -> str:
        """A new, empty directory for one container's allocation of `units`: its host path."""
        now = self.clock()
        allocation = f"{int(now)}-{secrets.token_hex(6)}"
        root = self.host.path(self.root)
        with self._lock:
            try:
                root.mkdir(parents=True, exist_ok=True)
                os.chown(root, 0, 0)  # the agent's own state directory: no pod reaches it
                os.chmod(root, 0o700)
                target = root / allocation
                os.mkdir(target, 0o700)
                os.chmod(target, 0o777)  # the pod's user is unknown here; see the docstring
            except OSError as e:
                raise HostError(
                    f"cannot create the stats directory {self.host_dir(allocation)}: "
                    f"{e.strerror or e}"
                ) from e
            records = self.records()
            records[allocation] = AllocationRecord(frozenset(units), now)
            self._save(records)
        return self.host_dir(allocation)

    def read(self, allocation: str) -> tuple[dict[str, EndpointStats], Counter[str]]:
        return read_directory(str(self.host.path(self.host_dir(allocation))))

    def on_disk(self) -> list[str]:
        return [n for n in self.host.listdir(self.root) if not n.startswith(".")]

    def remove_unowned(self, attribution: Attribution, grace: float | None = None) -> list[str]:
        """Remove the directories (and records) no container held for `grace` seconds
        (default: the instance's), directories without a record included; the ones
        removed."""
        grace = self.grace if grace is None else grace
        now = self.clock()
        with self._lock:
            records = self.records()
            unowned = set(attribution.unowned) | {
                a for a in self.on_disk() if a not in records and a not in attribution.owners
            }
            for a in list(self._unowned_since):
                if a not in unowned:
                    del self._unowned_since[a]
            removed = []
            for a in sorted(unowned):
                # the clock starts when this agent first sees it unowned: a new pod is
                # listed a moment after its Allocate, and a restarted agent waits again
                since = self._unowned_since.setdefault(a, now)
                if now - since < grace:
                    continue
                path = self.host.path(self.host_dir(a))
                # rmtree's fd-based walk does not follow symlinks the pod planted
                with contextlib.suppress(FileNotFoundError):
                    if path.is_symlink() or not path.is_dir():
                        path.unlink()
                    else:
                        shutil.rmtree(path)
                records.pop(a, None)
                self._unowned_since.pop(a, None)
                removed.append(a)
            if removed:
                self._save(records)
        return removed


# --- what is exported -----------------------------------------------------------------------


@dataclass
class Aggregate:
    """One container's endpoints, summed (counters) and aggregated over paths."""

    counters: dict[str, int] = field(default_factory=dict)
    io: dict[str, int] = field(default_factory=dict)
    endpoints_open: int = 0
    endpoints_closed: int = 0
    goodput_sent: float = 0.0
    goodput_rcvd: float = 0.0
    paths: int = 0
    paths_failed: int = 0
    srtt_us: tuple[float, float, float] | None = None
    """(min, mean, max) over live paths; None when there is none."""
    min_rtt_us: tuple[float, float, float] | None = None
    cwnd: tuple[float, float, float] | None = None


def _min_mean_max(values: list[int]) -> tuple[float, float, float] | None:
    if not values:
        return None
    return float(min(values)), math.fsum(values) / len(values), float(max(values))


def aggregate(
    endpoints: Mapping[str, EndpointStats],
    previous: Mapping[str, EndpointStats],
    now_ms: int,
) -> Aggregate:
    """Sum the endpoints of one container; goodput is payload bytes per second between a
    file's previous distinct snapshot and this one (0 for closed or stale endpoints)."""
    agg = Aggregate()
    live: list[PathFigures] = []
    for name, ep in endpoints.items():
        for k, v in ep.counters.items():
            agg.counters[k] = agg.counters.get(k, 0) + v
        for k, v in ep.io.items():
            agg.io[k] = agg.io.get(k, 0) + v
        if ep.closed:
            agg.endpoints_closed += 1
            continue
        agg.endpoints_open += 1
        if now_ms - ep.unix_ms > STALE_SECONDS * 1000:
            continue
        live += ep.paths
        prev = previous.get(name)
        if prev is not None and prev.pid == ep.pid and ep.unix_ms > prev.unix_ms:
            dt = (ep.unix_ms - prev.unix_ms) / 1000.0
            # bytes_acked leaves retransmits out; libraries before it have bytes_sent only
            sent_key = "bytes_acked" if "bytes_acked" in ep.counters else "bytes_sent"
            for attr, key in (("goodput_sent", sent_key), ("goodput_rcvd", "bytes_rcvd")):
                delta = ep.counters.get(key, 0) - prev.counters.get(key, 0)
                setattr(agg, attr, getattr(agg, attr) + max(delta, 0) / dt)
    agg.paths = len(live)
    agg.paths_failed = sum(1 for p in live if p.failed)
    ok = [p for p in live if not p.failed]
    agg.srtt_us = _min_mean_max([p.srtt_us for p in ok])
    agg.min_rtt_us = _min_mean_max([p.min_rtt_us for p in ok if p.min_rtt_us > 0])
    agg.cwnd = _min_mean_max([p.cwnd for p in ok])
    return agg


HoldersSource = Callable[[], Mapping[ContainerRef, frozenset[str]]]
"""Which units each container on the node holds (the PodResources API)."""


@dataclass
class ContainerStats:
    ref: ContainerRef
    stats: Aggregate


class TransportStats:
    """Reads every owned allocation's files and keeps what goodput needs between reads;
    attribution is refreshed at most every `refresh_s` (one PodResources `List`)."""

    def __init__(
        self,
        dirs: StatsDirectories,
        holders: HoldersSource | None,
        refresh_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dirs = dirs
        self.holders = holders
        self.refresh_s = refresh_s
        self.clock = clock
        self._lock = threading.Lock()
        self._attribution = Attribution()
        self._refreshed: float | None = None
        self._last: dict[tuple[str, str], EndpointStats] = {}
        self._prior: dict[tuple[str, str], EndpointStats] = {}
        """Per (allocation, file): the newest snapshot seen and the distinct one before."""
        self.refused: Counter[str] = Counter()
        self.attribution_errors = 0
        self.last_error = ""

    def refresh(self, force: bool = False, grace: float | None = None) -> Attribution:
        """Attribute the allocations (and remove the ones unowned for `grace` seconds,
        default the directories'; 0 on revert: the network leaves the node)."""
        with self._lock:
            now = self.clock()
            fresh = self._refreshed is not None and now - self._refreshed < self.refresh_s
            if self.holders is None or (fresh and not force):
                return self._attribution
            self._refreshed = now
            try:
                held = self.holders()
            except Exception as e:  # no kubelet answer: keep the last attribution
                self.attribution_errors += 1
                self.last_error = str(e)
                log.warning("stats attribution kept as it was: %s", e)
                return self._attribution
            self._attribution = attribute(self.dirs.records(), held)
            for a in self.dirs.remove_unowned(self._attribution, grace):
                log.info("removed stats directory %s: no pod holds it", self.dirs.host_dir(a))
            return self._attribution

    def read(self) -> tuple[list[ContainerStats], int]:
        """Each owned allocation's container and figures, and how many are unowned."""
        attribution = self.refresh()
        now_ms = int(time.time() * 1000)
        out = []
        with self._lock:
            last: dict[tuple[str, str], EndpointStats] = {}
            prior: dict[tuple[str, str], EndpointStats] = {}
            for allocation, ref in sorted(attribution.owners.items(), key=lambda i: i[1]):
                endpoints, refused = self.dirs.read(allocation)
                self.refused.update(refused)
                for name, ep in endpoints.items():
                    key = (allocation, name)
                    seen = self._last.get(key)
                    if seen is not None and ep.unix_ms <= seen.unix_ms:
                        # the same snapshot again (scrapes come faster than the
                        # library's 1 s period): keep the interval already measured
                        last[key] = seen
                        if key in self._prior:
                            prior[key] = self._prior[key]
                    else:
                        last[key] = ep
                        if seen is not None:
                            prior[key] = seen
                previous = {
                    n: prior[(allocation, n)] for n in endpoints if (allocation, n) in prior
                }
                current = {n: last[(allocation, n)] for n in endpoints}
                out.append(ContainerStats(ref, aggregate(current, previous, now_ms)))
            self._last, self._prior = last, prior
        return out, len(attribution.unowned)
