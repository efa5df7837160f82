"""A real Kubernetes control plane on this machine, with kwok-simulated nodes.

kind needs a container engine and these machines have none, so this module is the
project's envtest + kwok: pinned etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (built by ``hack/build-k8s.sh``) run as plain processes on
127.0.0.1 with free ports and a temporary directory. Tests, benchmarks and the demo
all use it, so what the demo shows is what the tests check.

Because there is no kube-proxy and a Service's endpoints may not be loopback
addresses, the cluster also has a small "pod network": a network namespace joined to
the host by a veth pair. A process started there (a webhook server, say) is reached by
the apiserver through a Service whose EndpointSlice points at the namespace's address.

Usage::

    with LocalCluster(nodes=[FakeNode("node-a", labels={"rdma": "true"})]) as cluster:
        cluster.kubectl("get", "nodes")
        api = cluster.api_client()           # kubernetes.client.ApiClient
        proc = cluster.pod_network.popen(["python3", "server.py"], log_name="server")
        cluster.expose_in_pod_network("default", "webhook", port=443, target_port=8443)

Standalone, for a person: ``python -m metaroce_harness.cluster up --nodes 3`` (or
``metaroce dev cluster up``) prints the kubeconfig path and runs until Ctrl-C.
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import itertools
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import yaml

from metaroce_harness.pki import CertificateAuthority, KeyPair, write_service_account_keys

log = logging.getLogger("metaroce.harness.cluster")

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO_ROOT / "hack" / "build-k8s.sh"
# qemu user networking maps this guest-side address to the host's loopback.
GUEST_HOST_ADDRESS = "10.0.2.2"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
KWOK_NODE_ANNOTATION = "kwok.x-k8s.io/node"
_TMP_PREFIX = "metaroce-cluster-"
_NETNS_PREFIX = "mr-podnet-"


class HarnessError(RuntimeError):
    """A component failed; the message names it and the log file to read."""


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metaroce"


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class Binaries:
    """Paths of the pinned binaries and data files made by hack/build-k8s.sh."""

    bin_dir: Path

    def __getitem__(self, name: str) -> str:
        path = self.bin_dir / name
        if not path.is_file():
            raise HarnessError(f"{name} is missing from {self.bin_dir}: re-run {BUILD_SCRIPT}")
        return str(path)

    @property
    def kwok_stages(self) -> Path:
        return self.bin_dir.parent / "kwok-stages.yaml"

    @property
    def deviceplugin_proto(self) -> Path:
        """The kubelet's device-plugin api.proto from the pinned k8s.io/kubelet module."""
        return self.bin_dir.parent / "deviceplugin-v1beta1-api.proto"


_binaries_lock = threading.Lock()
_binaries: Binaries | None = None


def ensure_binaries() -> Binaries:
    """Build (or reuse from the cache) the pinned Kubernetes binaries; progress on stderr."""
    global _binaries
    with _binaries_lock:
        if _binaries is None:
            if shutil.which("go") is None and not _cached_bin_dir_hint():
                raise HarnessError(
                    "Go is not installed, and the Kubernetes binaries are not cached: "
                    "install Go >= 1.26 (hack/setup.sh does) and re-run"
                )
            proc = subprocess.run(
                ["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=False
            )
            if proc.returncode != 0:
                raise HarnessError(
                    f"building the Kubernetes binaries failed ({BUILD_SCRIPT} exited "
                    f"{proc.returncode}); its last lines above name the log to read"
                )
            _binaries = Binaries(Path(proc.stdout.strip().splitlines()[-1]))
        return _binaries


def _cached_bin_dir_hint() -> bool:
    return any((cache_root() / "k8s").glob("*/.complete"))


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the component that takes it may race)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: Sequence[str], what: str) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise HarnessError(f"{what} failed: {' '.join(argv)}: {proc.stderr.strip()}")
    return proc.stdout


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class Component:
    """One process of the cluster, its log, and how to tell it is ready."""

    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def check_alive(self) -> None:
        code = self.process.poll()
        if code is None:
            return
        tail = _tail(self.log_path)
        hint = ""
        if "address already in use" in tail:
            hint = " (a port it needs is in use by another process)"
        raise HarnessError(
            f"{self.name} exited with code {code}{hint}; read {self.log_path}. Last lines:\n{tail}"
        )

    def stop(self, grace: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(grace)


def _spawn(name: str, argv: Sequence[str], log_dir: Path, log_name: str | None = None) -> Component:
    log_path = log_dir / f"{log_name or name}.log"
    with log_path.open("ab") as out:
        # A session of its own, so the whole process group can be signalled at stop.
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Component(name, proc, log_path)


def _wait(
    component: Component | None,
    what: str,
    probe: Callable[[], bool],
    timeout: float,
    log_path: Path | None = None,
) -> None:
    """Poll `probe` until true; fail naming the component and its log."""
    deadline = time.monotonic() + timeout
    while True:
        if component is not None:
            component.check_alive()
        try:
            if probe():
                return
        except Exception as exc:  # a probe failing is just "not yet"
            log.debug("%s not ready yet: %s", what, exc)
        if time.monotonic() > deadline:
            where = log_path or (component.log_path if component else None)
            raise HarnessError(
                f"{what} did not become ready within {timeout:.0f} s; read {where}"
                + (f". Last lines:\n{_tail(where)}" if where else "")
            )
        time.sleep(0.1)


def _https_ok(url: str, ctx: ssl.SSLContext) -> bool:
    with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
        return int(resp.status) == 200


def kubeconfig_yaml(server: str, ca: KeyPair, client: KeyPair, user: str = "admin") -> str:
    """A kubeconfig with everything embedded, so it can be copied anywhere (into a guest)."""

    def b64(data: bytes) -> str:
        return base64.b64encode(data).decode()

    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "metaroce-local",
                "cluster": {"server": server, "certificate-authority-data": b64(ca.cert_pem())},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate-data": b64(client.cert_pem()),
                    "client-key-data": b64(client.key_pem()),
                },
            }
        ],
        "contexts": [
            {"name": "metaroce-local", "context": {"cluster": "metaroce-local", "user": user}}
        ],
        "current-context": "metaroce-local",
    }
    return yaml.safe_dump(doc, sort_keys=False)


# --------------------------------------------------------------------------- nodes


@dataclass
class FakeNode:
    """A kwok-managed Node: labels, capacity (= allocatable) and taints of our choosing.

    Extended resources go into ``capacity`` (e.g. ``{"metaroce.io/backend": "8"}``);
    the scheduler fits against allocatable, so both get the same values.
    """

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    capacity: Mapping[str, str] = field(default_factory=dict)
    taints: Sequence[Mapping[str, str]] = ()

    def manifest(self) -> dict[str, Any]:
        capacity = {"cpu": "32", "memory": "256Gi", "pods": "110", **self.capacity}
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "annotations": {KWOK_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kwok",
                    **self.labels,
                },
            },
            "spec": {"taints": [dict(t) for t in self.taints]},
            # Nodes are the one kind whose status may be set on create.
            "status": {"capacity": capacity, "allocatable": dict(capacity)},
        }


# --------------------------------------------------------------------------- pod network

_podnet_counter = itertools.count()


class PodNetwork:
    """A network namespace joined to the host by a veth pair: a stand-in pod network.

    The apiserver may not use loopback endpoints, so processes that must be reached
    through a Service run here, at `pod_ip`; they reach the host at `host_ip`.
    """

    def __init__(self, log_dir: Path) -> None:
        index = next(_podnet_counter)
        tag = f"{os.getpid() % 100000}x{index}"
        self.netns = f"{_NETNS_PREFIX}{tag}"
        self.host_if = f"mrh{tag}"[:15]
        self.ns_if = f"mrp{tag}"[:15]
        # A /30 per pod network, unique per process and index.
        block = (os.getpid() * 8 + index) % (64 * 256)
        base = f"10.{213 + block // 16384}.{(block // 64) % 256}.{(block % 64) * 4}"
        octets = [int(x) for x in base.split(".")]
        self.host_ip = ".".join(map(str, [*octets[:3], octets[3] + 1]))
        self.pod_ip = ".".join(map(str, [*octets[:3], octets[3] + 2]))
        self.log_dir = log_dir
        self.processes: list[Component] = []
        self._created = False

    def create(self) -> None:
        if os.geteuid() != 0:
            raise HarnessError("the pod network needs root (ip netns, veth); run as root")
        _run(["ip", "netns", "add", self.netns], "creating the pod network namespace")
        self._created = True
        steps = [
            ["ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if],
            ["ip", "link", "set", self.ns_if, "netns", self.netns],
            ["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if],
            ["ip", "link", "set", self.host_if, "up"],
            ["ip", "-n", self.netns, "addr", "add", f"{self.pod_ip}/30", "dev", self.ns_if],
            ["ip", "-n", self.netns, "link", "set", self.ns_if, "up"],
            ["ip", "-n", self.netns, "link", "set", "lo", "up"],
            ["ip", "-n", self.netns, "route", "add", "default", "via", self.host_ip],
        ]
        for argv in steps:
            _run(argv, "setting up the pod network")

    def popen(self, argv: Sequence[str], log_name: str) -> Component:
        """Start a process inside the namespace; it is stopped with the cluster."""
        comp = _spawn(log_name, ["ip", "netns", "exec", self.netns, *argv], self.log_dir)
        self.processes.append(comp)
        return comp

    def delete(self) -> None:
        for comp in self.processes:
            comp.stop()
        if not self._created:
            return
        # Anything else still inside (started by hand) goes too.
        pids = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        # Deleting the namespace destroys the veth pair with it.
        subprocess.run(["ip", "netns", "delete", self.netns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "delete", self.host_if], capture_output=True, check=False)
        self._created = False


# --------------------------------------------------------------------------- the cluster

_live_clusters: set[LocalCluster] = set()


def _stop_all_at_exit() -> None:
    for cluster in list(_live_clusters):
        cluster.stop()


atexit.register(_stop_all_at_exit)


def _on_sigterm(signum: int, _frame: object) -> None:
    # Tear down first, then die of the same signal: raising SystemExit instead would be
    # caught by a test runner as one failed test while the session (and the cluster) went on.
    _stop_all_at_exit()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_sigterm_handler() -> None:
    # SIGTERM would bypass atexit and leave processes, namespaces and temp dirs behind.
    if threading.current_thread() is threading.main_thread() and signal.getsignal(
        signal.SIGTERM
    ) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, _on_sigterm)


class LocalCluster:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok on 127.0.0.1."""

    def __init__(
        self,
        nodes: Sequence[FakeNode] = (),
        *,
        start_timeout: float = 90.0,
        extra_apiserver_args: Sequence[str] = (),
    ) -> None:
        self.initial_nodes = list(nodes)
        self.start_timeout = start_timeout
        self.extra_apiserver_args = list(extra_apiserver_args)
        self.components: list[Component] = []
        self.pod_network: PodNetwork | None = None
        self.workdir: Path | None = None
        self.log_dir: Path | None = None
        self.ready_seconds: float | None = None
        self.binaries: Binaries | None = None
        self._api_port = 0

    # -- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        started = time.monotonic()
        self.binaries = ensure_binaries()
        _install_sigterm_handler()
        _live_clusters.add(self)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.ready_seconds = time.monotonic() - started
        log.info("cluster ready in %.1f s: KUBECONFIG=%s", self.ready_seconds, self.kubeconfig)
        return self

    def _start(self) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{os.getpid()}-"))
        # Logs outlive the temp dir so that a failure can be read after teardown.
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.log_dir = cache_root() / "logs" / f"cluster-{stamp}-{os.getpid()}-{id(self) % 10000}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        _prune_old_logs(cache_root() / "logs", keep=20)
        log.info("starting local cluster (logs: %s)", self.log_dir)

        # Always made: besides hosting webhook servers, its host-side address is what the
        # apiserver advertises (the `kubernetes` Service may not point at loopback).
        self.pod_network = PodNetwork(self.log_dir)
        self.pod_network.create()
        self._write_pki()
        self._start_etcd()
        self._start_apiserver()
        self._start_controllers()
        if self.initial_nodes:
            self.add_nodes(self.initial_nodes)

    def stop(self) -> None:
        """Stop every process and remove the namespace and temp dir; safe to call twice."""
        for comp in reversed(self.components):
            comp.stop()
        self.components.clear()
        if self.pod_network is not None:
            self.pod_network.delete()
            self.pod_network = None
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        _live_clusters.discard(self)

    # -- start-up steps ---------------------------------------------------------------

    @property
    def _dir(self) -> Path:
        assert self.workdir is not None, "the cluster is not started"
        return self.workdir

    @property
    def _logs(self) -> Path:
        assert self.log_dir is not None, "the cluster is not started"
        return self.log_dir

    @property
    def _bin(self) -> Binaries:
        assert self.binaries is not None, "the cluster is not started"
        return self.binaries

    def _write_pki(self) -> None:
        pki = self._dir / "pki"
        self.ca = CertificateAuthority(pki)
        ips = ["127.0.0.1", GUEST_HOST_ADDRESS, KUBERNETES_SERVICE_IP]
        if self.pod_network:
            ips.append(self.pod_network.host_ip)
        self.apiserver_pair = self.ca.issue(
            "apiserver",
            "kube-apiserver",
            dns_names=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ip_addresses=tuple(ips),
            server=True,
        )
        self.admin_pair = self.ca.issue(
            "admin", "admin", organization="system:masters", client=True
        )
        self.kubelet_client_pair = self.ca.issue(
            "apiserver-kubelet-client",
            "kube-apiserver-kubelet-client",
            organization="system:masters",
            client=True,
        )
        self.sa_keys = write_service_account_keys(pki)
        self._api_port = free_port()
        self.kubeconfig = self._dir / "admin.kubeconfig"
        self.kubeconfig.write_text(kubeconfig_yaml(self.server, self.ca.pair, self.admin_pair))
        self._ssl = ssl.create_default_context(cafile=str(self.ca.pair.cert))
        self._ssl.load_cert_chain(str(self.admin_pair.cert), str(self.admin_pair.key))

    def _identity_kubeconfig(self, stem: str, user: str, group: str | None = None) -> Path:
        pair = self.ca.issue(stem, user, organization=group, client=True)
        path = self._dir / f"{stem}.kubeconfig"
        path.write_text(kubeconfig_yaml(self.server, self.ca.pair, pair, user=user))
        return path

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        etcd = _spawn(
            "etcd",
            [
                self._bin["etcd"],
                "--name=default",
                f"--data-dir={self._dir / 'etcd'}",
                f"--listen-client-urls={self.etcd_url}",
                f"--advertise-client-urls={self.etcd_url}",
                f"--listen-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                f"--initial-cluster=default=http://127.0.0.1:{peer}",
                # Throwaway data: durability costs start-up and write time for nothing.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
            self._logs,
        )
        self.components.append(etcd)
        _wait(etcd, "etcd", lambda: _http_ok(f"{self.etcd_url}/health"), self.start_timeout)

    def _start_apiserver(self) -> None:
        assert self.pod_network is not None
        advertise = self.pod_network.host_ip
        pki = self._dir / "pki"
        args = [
            self._bin["kube-apiserver"],
            f"--etcd-servers={self.etcd_url}",
            # 0.0.0.0: guests reach it at 10.0.2.2 (qemu maps that to loopback) and the
            # pod network at its veth address.
            "--bind-address=0.0.0.0",
            f"--secure-port={self._api_port}",
            f"--advertise-address={advertise}",
            f"--tls-cert-file={self.apiserver_pair.cert}",
            f"--tls-private-key-file={self.apiserver_pair.key}",
            f"--client-ca-file={self.ca.pair.cert}",
            f"--kubelet-client-certificate={self.kubelet_client_pair.cert}",
            f"--kubelet-client-key={self.kubelet_client_pair.key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={self.sa_keys.cert}",
            f"--service-account-signing-key-file={self.sa_keys.key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            # The defaults plus NodeRestriction, as kubeadm enables.
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            # No kube-proxy: webhook and aggregated calls go to endpoints directly.
            "--enable-aggregator-routing=true",
            "--max-requests-inflight=800",
            "--max-mutating-requests-inflight=400",
            "--profiling=false",
            f"--cert-dir={pki}",
            *self.extra_apiserver_args,
        ]
        apiserver = _spawn("kube-apiserver", args, self._logs)
        self.components.append(apiserver)
        _wait(
            apiserver,
            "kube-apiserver",
            lambda: _https_ok(f"{self.server}/readyz", self._ssl),
            self.start_timeout,
        )

    def _start_controllers(self) -> None:
        pki = self._dir / "pki"
        cm_kc = self._identity_kubeconfig("controller-manager", "system:kube-controller-manager")
        sched_kc = self._identity_kubeconfig("scheduler", "system:kube-scheduler")
        kwok_kc = self._identity_kubeconfig("kwok", "kwok", "system:masters")
        cm_port, sched_port = free_port(), free_port()
        sched_cfg = self._dir / "scheduler.yaml"
        sched_cfg.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "kubescheduler.config.k8s.io/v1",
                    "kind": "KubeSchedulerConfiguration",
                    "clientConnection": {"kubeconfig": str(sched_kc), "qps": 200, "burst": 400},
                    "leaderElection": {"leaderElect": False},
                }
            )
        )
        cm = _spawn(
            "kube-controller-manager",
            [
                self._bin["kube-controller-manager"],
                f"--kubeconfig={cm_kc}",
                f"--authentication-kubeconfig={cm_kc}",
                f"--authorization-kubeconfig={cm_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={cm_port}",
                f"--cert-dir={pki / 'cm'}",
                f"--service-account-private-key-file={self.sa_keys.key}",
                f"--root-ca-file={self.ca.pair.cert}",
                f"--cluster-signing-cert-file={self.ca.pair.cert}",
                f"--cluster-signing-key-file={self.ca.pair.key}",
                "--use-service-account-credentials=true",
                "--leader-elect=false",
                "--kube-api-qps=200",
                "--kube-api-burst=400",
                "--concurrent-daemonset-syncs=4",
                "--node-monitor-grace-period=180s",
            ],
            self._logs,
        )
        sched = _spawn(
            "kube-scheduler",
            [
                self._bin["kube-scheduler"],
                f"--config={sched_cfg}",
                f"--authentication-kubeconfig={sched_kc}",
                f"--authorization-kubeconfig={sched_kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={sched_port}",
                f"--cert-dir={pki / 'sched'}",
            ],
            self._logs,
        )
        kwok = _spawn(
            "kwok",
            [
                self._bin["kwok"],
                f"--kubeconfig={kwok_kc}",
                f"--config={self._bin.kwok_stages}",
                f"--manage-nodes-with-annotation-selector={KWOK_NODE_ANNOTATION}=fake",
                # Long leases and a long grace period keep 1,000 simulated nodes Ready
                # on 2 busy cores (a late heartbeat must not flip a node NotReady).
                "--node-lease-duration-seconds=60",
                "--cidr=10.128.0.1/10",
                "--node-ip=10.0.2.15",
            ],
            self._logs,
        )
        self.components += [cm, sched, kwok]
        insecure = ssl.create_default_context()
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        _wait(
            cm,
            "kube-controller-manager",
            lambda: _https_ok(f"https://127.0.0.1:{cm_port}/healthz", insecure),
            self.start_timeout,
        )
        _wait(
            sched,
            "kube-scheduler",
            lambda: _https_ok(f"https://127.0.0.1:{sched_port}/healthz", insecure),
            self.start_timeout,
        )
        # The default ServiceAccount must exist before pods can be created in a namespace.
        _wait(
            cm,
            "kube-controller-manager (default ServiceAccount)",
            lambda: (
                self.kubectl("get", "sa", "default", "-n", "default", check=False).returncode == 0
            ),
            self.start_timeout,
        )
        self._kwok = kwok

    # -- access -----------------------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self._api_port}"

    @property
    def api_port(self) -> int:
        return self._api_port

    def guest_kubeconfig(self) -> str:
        """Admin kubeconfig text for a qemu guest (reaches the host at 10.0.2.2)."""
        return kubeconfig_yaml(
            f"https://{GUEST_HOST_ADDRESS}:{self._api_port}", self.ca.pair, self.admin_pair
        )

    def pod_network_kubeconfig(self) -> Path:
        """Admin kubeconfig for processes in the pod network (they reach the host's veth)."""
        assert self.pod_network is not None, "the cluster is not started"
        path = self._dir / "podnet-admin.kubeconfig"
        if not path.exists():
            server = f"https://{self.pod_network.host_ip}:{self._api_port}"
            path.write_text(kubeconfig_yaml(server, self.ca.pair, self.admin_pair))
        return path

    def kubeconfig_for(self, user: str, groups: Sequence[str] = ()) -> Path:
        """A kubeconfig authenticating as `user` (for RBAC checks of real identities)."""
        stem = "user-" + user.replace(":", "_").replace("/", "_")
        org = ",".join(groups) if groups else None
        return self._identity_kubeconfig(stem, user, org)

    def issue_serving_cert(
        self, stem: str, dns_names: Sequence[str] = (), ip_addresses: Sequence[str] = ()
    ) -> KeyPair:
        """A server certificate signed by the cluster CA (for test webhook servers)."""
        return self.ca.issue(
            stem,
            dns_names[0] if dns_names else stem,
            dns_names=tuple(dns_names),
            ip_addresses=tuple(ip_addresses),
            server=True,
        )

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 120.0,
        kubeconfig: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned kubectl against this cluster."""
        argv = [self._bin["kubectl"], f"--kubeconfig={kubeconfig or self.kubeconfig}", *args]
        proc = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise HarnessError(
                f"kubectl {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}"
            )
        return proc

    def helm(
        self, *args: str, check: bool = True, timeout: float = 300.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the pinned helm against this cluster, with its state kept in the temp dir."""
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self._dir / "helm" / "cache"),
            "HELM_CONFIG_HOME": str(self._dir / "helm" / "config"),
            "HELM_DATA_HOME": str(self._dir / "helm" / "data"),
        }
        proc = subprocess.run(
            [self._bin["helm"], *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            check=False,
        )
        if check and proc.returncode != 0:
            raise HarnessError(f"helm {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
        return proc

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient for the admin identity."""
        from kubernetes import config  # imported late: the harness CLI does not need it

        return config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=str(self.kubeconfig)
        )

    # -- nodes --------------------------------------------------------------------------

    def add_nodes(
        self, nodes: Sequence[FakeNode], *, wait_ready: bool = True, timeout: float = 600.0
    ) -> float:
        """Create kwok nodes in parallel; optionally wait until all are Ready. Returns seconds."""
        from kubernetes import client

        started = time.monotonic()
        api = client.CoreV1Api(self.api_client())

        def create(node: FakeNode) -> None:
            api.create_node(cast(Any, node.manifest()))  # the client accepts plain dicts

        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(create, nodes))
        log.info("created %d kwok nodes in %.1f s", len(nodes), time.monotonic() - started)
        if wait_ready:
            names = {n.name for n in nodes}
            _wait(
                self._kwok,
                f"kwok ({len(names)} nodes Ready)",
                lambda: names <= self.ready_nodes(api),
                timeout,
            )
        return time.monotonic() - started

    @staticmethod
    def ready_nodes(api: Any) -> set[str]:
        """Names of the nodes whose Ready condition is True (api: a CoreV1Api)."""
        ready: set[str] = set()
        for node in api.list_node(resource_version="0").items:
            for cond in node.status.conditions or []:
                if cond.type == "Ready" and cond.status == "True":
                    ready.add(node.metadata.name)
        return ready

    # -- pod network services ---------------------------------------------------------

    def expose_in_pod_network(
        self, namespace: str, name: str, *, port: int, target_port: int
    ) -> None:
        """A selector-less Service + hand-made EndpointSlice pointing at the pod network."""
        if self.pod_network is None:
            raise HarnessError("the cluster is not started")
        docs = [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"ports": [{"name": "https", "port": port, "targetPort": target_port}]},
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{name}-podnet",
                    "namespace": namespace,
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": "IPv4",
                "endpoints": [
                    {"addresses": [self.pod_network.pod_ip], "conditions": {"ready": True}}
                ],
                "ports": [{"name": "https", "port": target_port, "protocol": "TCP"}],
            },
        ]
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return int(resp.status) == 200


def _prune_old_logs(root: Path, keep: int) -> None:
    dirs = sorted(root.glob("cluster-*"), key=lambda p: p.stat().st_mtime)
    for old in dirs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def leftovers(pid: int | None = None) -> list[str]:
    """Processes, namespaces and temp dirs left by clusters (of process `pid`, or of any)."""
    tag = "" if pid is None else f"{pid}-"
    found: list[str] = []
    found += [str(p) for p in Path(tempfile.gettempdir()).glob(f"{_TMP_PREFIX}{tag}*")]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    ns_tag = "" if pid is None else f"{pid % 100000}x"
    found += [
        f"netns {line.split()[0]}"
        for line in netns.stdout.splitlines()
        if line.startswith(_NETNS_PREFIX + ns_tag)
    ]
    names = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
    bin_root = str(cache_root() / "k8s")
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError):
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode()
            if not (argv0.startswith(bin_root) and Path(argv0).name in names):
                continue
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if pid is None or ppid == pid:
                found.append(f"process {proc.name} {argv0}")
    return found


@contextlib.contextmanager
def session_cluster(nodes: Sequence[FakeNode]) -> Iterator[LocalCluster]:
    """A started control plane for a test session; stopped after, and nothing of this
    process may be left behind (AssertionError naming what was)."""
    logging.getLogger("metaroce").setLevel(logging.INFO)
    local = LocalCluster(list(nodes))
    local.start()
    print(f"\n[harness] control plane ready in {local.ready_seconds:.1f} s ({local.log_dir})")
    try:
        yield local
    finally:
        local.stop()
        left = leftovers(os.getpid())
        assert not left, f"the harness left these behind after the session: {left}"


def fresh_namespace(cluster: LocalCluster, prefix: str) -> str:
    """A new namespace `<prefix>-<random>`, returned once its default ServiceAccount
    exists (pods cannot be created in it before)."""
    name = f"{prefix}-{os.urandom(4).hex()}"
    cluster.kubectl("create", "namespace", name)
    deadline = time.monotonic() + 30
    while cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode != 0:
        assert time.monotonic() < deadline, f"namespace {name} got no default ServiceAccount"
        time.sleep(0.2)
    return name


# --------------------------------------------------------------------------- CLI


def fake_nodes(
    count: int, prefix: str = "node", labels: Mapping[str, str] | None = None
) -> list[FakeNode]:
    return [FakeNode(f"{prefix}-{i}", labels=dict(labels or {})) for i in range(count)]


@contextlib.contextmanager
def running_cluster(nodes: int) -> Iterator[LocalCluster]:
    with LocalCluster(fake_nodes(nodes)) as cluster:
        yield cluster


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="metaroce dev cluster", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a local cluster and keep it running until Ctrl-C")
    up.add_argument("--nodes", type=int, default=3, help="kwok nodes to create (default 3)")
    sub.add_parser("build", help="build or reuse the pinned Kubernetes binaries")
    sub.add_parser("leftovers", help="list processes, namespaces, temp dirs left by clusters")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[cluster] %(message)s")
    if args.command == "build":
        print(ensure_binaries().bin_dir)
        return 0
    if args.command == "leftovers":
        left = leftovers()
        print("\n".join(left) or "nothing left behind")
        return 1 if left else 0
    if args.nodes < 0:
        parser.error(f"--nodes: {args.nodes} is negative; give 0 or more")
    try:
        with running_cluster(args.nodes) as cluster:
            kubectl = cluster._bin["kubectl"]
            print(f"cluster ready in {cluster.ready_seconds:.1f} s")
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(f"kubectl: {kubectl}")
            print("Ctrl-C stops it and removes everything it made.")
            signal.pause()
    except KeyboardInterrupt:
        pass
    except HarnessError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
