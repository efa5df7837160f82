"""Real Kubernetes nodes: containerd + CNI + the pinned kubelet in the SoftRoCE guests.

``RealNodes`` turns a ``GuestCluster`` into nodes of a ``LocalCluster``'s control plane:

- the guests run Debian's containerd and runc (cgroup v2, cgroupfs driver); their
  ``/var/lib/containerd`` (a tmpfs) starts from ``hack/build-images.sh``'s
  ``node-containerd.tar`` (pause, agent and rdma-test already unpacked; shared read-only
  over 9p at ``/opt/metaroce-images``; no registry), and the pause image of that build
  is the sandbox image;
- Multus (``multus.py``): the thin plugin, built at a pinned version, first in the CNI
  conf dir, delegating the cluster network to the network below; its NAD CRD and RBAC
  are installed on the cluster before the guests start;
- CNI: a ``bridge`` + ``host-local`` network per guest (``node-N`` owns
  ``10.244.N.0/24``), routes to the other guests' pod subnets over ``eth0`` and
  masquerading only towards ``eth1`` (the host), so pods on two guests talk with their
  own addresses;
- no kube-proxy: the ``kubernetes`` Service VIP (10.96.0.1:443) is DNATed in each guest
  to the apiserver at 10.0.2.2 (the host's loopback through qemu user networking; the
  apiserver's certificate names both);
- the kubelet (``hack/build-k8s.sh``'s, shared over 9p at ``/opt/k8s-bin``) runs with a
  static config file and a client certificate for ``system:node:node-N`` (group
  ``system:nodes``), registers ``node-N`` with ``InternalIP`` 192.168.77.(10+N) (its
  ``eth0``, the RoCE network);
- the apiserver reaches each kubelet (``kubectl logs/exec``) at ``192.168.77.(10+N):10250``:
  those addresses are put on the host's ``lo`` (label ``lo:mrk<pid>``, local route with
  source 127.0.0.1) and qemu forwards them into the guests (``hostfwd``). Removed again
  by ``close()``.

Usage::

    with LocalCluster(extra_apiserver_args=APISERVER_ARGS) as cluster, \
            RealNodes(cluster, count=2) as nodes:
        cluster.kubectl("get", "nodes")          # node-1, node-2 Ready
        nodes.restart_kubelet(nodes.guests[0])

Cleanup: ``close()`` deletes the Node objects, stops the guests (kubelet, containerd and
every container die with them) and removes the node addresses from the host's lo.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import fcntl
import json
import logging
import os
import signal
import subprocess
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from metaroce_harness import multus
from metaroce_harness.cluster import (
    GUEST_HOST_ADDRESS,
    KUBERNETES_SERVICE_IP,
    LocalCluster,
    ensure_binaries,
)
from metaroce_harness.guests import Guest, GuestCluster, guest_ip
from metaroce_harness.images import ImageSet, find_images

log = logging.getLogger("metaroce.harness.nodes")

POD_CIDR_PREFIX = "10.244"
KUBELET_PORT = 10250
GUEST_IMAGES_DIR = "/opt/metaroce-images"
GUEST_K8S_BIN = "/opt/k8s-bin"
GUEST_NODE_DIR = "/etc/metaroce-node"
# The LocalCluster of real nodes needs these (LocalCluster(extra_apiserver_args=...)):
# the apiserver reaches a kubelet at its InternalIP (the node names do not resolve on
# the host).
APISERVER_ARGS = ("--kubelet-preferred-address-types=InternalIP",)
_LABEL_PREFIX = "lo:mrk"
# Every RealNodes uses the same node addresses, so two at once on one host (a CI run
# beside a developer's run) wait for each other on this lock instead of failing. The
# kernel drops a flock when its holder dies, so a killed run never leaves it held.
HOST_LOCK = Path("/run/lock/metaroce-real-nodes.lock")
HOST_LOCK_WAIT_ENV = "METAROCE_REAL_NODES_WAIT"
HOST_LOCK_WAIT_DEFAULT = 1800.0


_live: set[RealNodes] = set()


def _remove_live_addresses() -> None:
    for nodes in list(_live):
        nodes.remove_host_addresses()


atexit.register(_remove_live_addresses)


def _install_sigterm_handler() -> None:
    """Remove the host addresses on SIGTERM too, then let the previous handler run
    (LocalCluster's stops the control plane and re-raises the signal)."""
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if getattr(previous, "_metaroce_nodes", False):
        return

    def handler(signum: int, frame: Any) -> None:
        _remove_live_addresses()
        if callable(previous):
            previous(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    handler._metaroce_nodes = True  # type: ignore[attr-defined]
    signal.signal(signal.SIGTERM, handler)


class NodeError(RuntimeError):
    """A node did not come up; the message names the guest and the log to read."""


def pod_cidr(index: int) -> str:
    """The pod subnet of guest ``index`` (0-based): node-N has 10.244.N.0/24."""
    return f"{POD_CIDR_PREFIX}.{index + 1}.0/24"


def containerd_config(pause_ref: str) -> str:
    return textwrap.dedent(
        f"""\
        version = 2
        [plugins."io.containerd.grpc.v1.cri"]
          sandbox_image = "{pause_ref}"
          [plugins."io.containerd.grpc.v1.cri".containerd]
            snapshotter = "overlayfs"
            default_runtime_name = "runc"
            [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
              runtime_type = "io.containerd.runc.v2"
          [plugins."io.containerd.grpc.v1.cri".cni]
            bin_dir = "/usr/lib/cni"
            conf_dir = "/etc/cni/net.d"
        """
    )


def cni_config(index: int) -> str:
    conf = {
        "cniVersion": "0.4.0",
        "name": "metaroce-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                # Masquerading is done once, towards eth1 only (see setup_script).
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr(index)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
    return json.dumps(conf, indent=2) + "\n"


def kubelet_config() -> str:
    conf: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        # All addresses: the apiserver comes in through qemu user networking (eth1).
        "address": "0.0.0.0",
        "port": KUBELET_PORT,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": f"{GUEST_NODE_DIR}/ca.crt"},
        },
        "authorization": {"mode": "Webhook"},
        # containerd 1.6 has no RuntimeConfig RPC: the kubelet falls back to this.
        "cgroupDriver": "cgroupfs",
        "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
        "failSwapOn": False,
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        "maxPods": 32,
        "serializeImagePulls": False,
        # The images live on a tmpfs and cannot be pulled again: never collect them,
        # never evict for disk pressure.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "20Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "nodeStatusReportFrequency": "10s",
        "syncFrequency": "10s",
        "fileCheckFrequency": "10s",
    }
    return yaml.safe_dump(conf, sort_keys=False)


def setup_script(index: int, count: int, api_port: int, pause_ref: str) -> str:
    """The guest-side preparation of node ``index``: kernel, mounts, network, config."""
    peers = "\n".join(
        f"ip route replace {pod_cidr(j)} via {guest_ip(j)} dev eth0"
        for j in range(count)
        if j != index
    )
    vip = KUBERNETES_SERVICE_IP
    api = f"{GUEST_HOST_ADDRESS}:{api_port}"
    return textwrap.dedent(
        f"""\
        set -eu
        # Bidirectional mount propagation for the kubelet and the runtime.
        mount --make-rshared /
        for m in overlay bridge br_netfilter veth nf_conntrack nf_nat iptable_nat \\
                 iptable_filter xt_MASQUERADE xt_conntrack xt_addrtype xt_comment; do
          modprobe "$m"
        done
        echo 1 >/proc/sys/net/ipv4/ip_forward
        echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables
        # overlayfs may not have an overlay (the guest root) as its upper layer.
        mkdir -p /var/lib/containerd /var/lib/kubelet /run/containerd /etc/containerd \\
                 /etc/cni/net.d /var/log/metaroce
        mountpoint -q /var/lib/containerd || mount -t tmpfs -o mode=711 tmpfs /var/lib/containerd
        [ -s /etc/machine-id ] || cat /proc/sys/kernel/random/uuid | tr -d - >/etc/machine-id
        {peers}
        # No kube-proxy: the kubernetes Service VIP goes straight to the apiserver.
        iptables -t nat -A OUTPUT -d {vip}/32 -p tcp --dport 443 -j DNAT --to-destination {api}
        iptables -t nat -A PREROUTING -d {vip}/32 -p tcp --dport 443 -j DNAT \\
          --to-destination {api}
        iptables -t nat -A POSTROUTING -s {POD_CIDR_PREFIX}.0.0/16 -o eth1 -j MASQUERADE
        """
    )


class RealNodes:
    """Guests of a ``GuestCluster`` registered as kubelet nodes of a ``LocalCluster``."""

    def __init__(
        self,
        cluster: LocalCluster,
        count: int = 2,
        *,
        memory_mb: int = 2048,
        images: ImageSet | None = None,
        ready_timeout: float = 300.0,
    ) -> None:
        if count < 1 or count > 9:
            raise ValueError(f"count={count}: real nodes are 1 to 9 guests (one /24 each)")
        self.cluster = cluster
        self.count = count
        self.memory_mb = memory_mb
        self.images = images
        self.ready_timeout = ready_timeout
        self.guests: GuestCluster | None = None
        # The node addresses go on the host's lo under this label (no dummy module needed).
        self.addr_label = f"{_LABEL_PREFIX}{os.getpid() % 100000}"
        self._host_addrs: list[str] = []
        self.kubelets: dict[str, Any] = {}
        self._multus_token = ""
        self.timings: dict[str, float] = {}
        self._host_lock: int | None = None

    # -- lifecycle --
    def __enter__(self) -> RealNodes:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def names(self) -> list[str]:
        return [f"node-{i + 1}" for i in range(self.count)]

    def start(self) -> RealNodes:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def _start(self) -> None:
        t0 = time.monotonic()
        if self.images is None:
            self.images = find_images()
        bins = ensure_binaries()
        kubelet = Path(bins["kubelet"])
        multus_dir = multus.ensure_multus()
        self._host_lock = take_host_lock(HOST_LOCK, _host_lock_wait())
        self.timings["host lock"] = time.monotonic() - t0
        # Multus's CRD and RBAC: cluster prerequisites, as a platform installs them
        self._multus_token = multus.install_prerequisites(self.cluster, multus_dir)
        self._add_host_addresses()
        self.guests = GuestCluster(
            self.count,
            memory_mb=self.memory_mb,
            shares={
                GUEST_IMAGES_DIR: self.images.root,
                GUEST_K8S_BIN: kubelet.parent,
                multus.GUEST_MULTUS_DIR: multus_dir,
            },
            host_forwards=lambda i: [
                f"tcp:{guest_ip(i)}:{KUBELET_PORT}-:{KUBELET_PORT}",
            ],
        ).start()
        self.timings["boot"] = time.monotonic() - t0
        with ThreadPoolExecutor(max_workers=self.count) as pool:
            list(pool.map(self._prepare, self.guests))
        self.timings["containerd+images"] = time.monotonic() - t0 - self.timings["boot"]
        for g in self.guests:
            self.start_kubelet(g)
        self.wait_ready()
        self.timings["total"] = time.monotonic() - t0
        log.info("real nodes ready: %s", self.timings)

    def _add_host_addresses(self) -> None:
        _sweep_stale_addresses()
        _live.add(self)
        _install_sigterm_handler()
        for i in range(self.count):
            a = [
                "ip",
                "addr",
                "add",
                f"{guest_ip(i)}/32",
                "dev",
                "lo",
                "label",
                self.addr_label,
            ]
            proc = subprocess.run(a, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise NodeError(
                    f"{' '.join(a)} failed: {proc.stderr.strip()} (another RealNodes running? "
                    "`ip -o addr show dev lo` lists the node addresses in use)"
                )
            self._host_addrs.append(guest_ip(i))
            # Connections to the address must leave from 127.0.0.1: qemu shows that to
            # the guest as 10.0.2.2, while the node's own address as source would be
            # answered over eth0 and lost.
            r = [
                "ip", "route", "replace", "local", guest_ip(i), "dev", "lo", "table",
                "local", "proto", "kernel", "scope", "host", "src", "127.0.0.1",
            ]  # fmt: skip
            proc = subprocess.run(r, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise NodeError(f"{' '.join(r)} failed: {proc.stderr.strip()}")

    def _api_port(self) -> int:
        return int(self.cluster.server.rsplit(":", 1)[1])

    def _prepare(self, g: Guest) -> None:
        """containerd up, images imported, CNI and kubelet configuration written."""
        assert self.images is not None
        t0 = time.monotonic()
        g.write_file(
            "/run/metaroce/node-setup.sh",
            setup_script(g.index, self.count, self._api_port(), self.images.pause.ref),
        )
        self._check(g, "bash /run/metaroce/node-setup.sh", "node setup", timeout=120)
        log.info("%s: node setup done in %.1f s", g.name, time.monotonic() - t0)
        # build-images.sh made containerd's state with the node images unpacked: under
        # TCG, containerd unpacks the agent image in many minutes, tar in well under one.
        self._check(
            g,
            f"tar -xpf {GUEST_IMAGES_DIR}/{self.images.node_state.name} "
            "--xattrs --xattrs-include='trusted.*' -C /var/lib/containerd",
            "unpack the node images (containerd state)",
            600,
        )
        log.info("%s: containerd state in place after %.1f s", g.name, time.monotonic() - t0)
        g.write_file("/etc/containerd/config.toml", containerd_config(self.images.pause.ref))
        g.start(
            "exec containerd --config /etc/containerd/config.toml "
            ">/var/log/metaroce/containerd.log 2>&1"
        )
        deadline = time.monotonic() + 60
        while g.run("ctr version", timeout=30).returncode != 0:
            if time.monotonic() > deadline:
                raise NodeError(
                    f"{g.name}: containerd did not answer in 60 s: "
                    f"{g.run('tail -n 20 /var/log/metaroce/containerd.log').stdout}"
                )
            time.sleep(0.5)
        # Multus first in containerd's conf dir, delegating the cluster network to the
        # guest's bridge + host-local (the same conflist, kept for reading)
        self._check(g, multus.guest_setup_script(), "install Multus", timeout=60)
        g.write_file("/etc/cni/net.d/10-metaroce.conflist", cni_config(g.index))
        g.write_file(
            multus.CONF_FILE, multus.multus_config(json.loads(cni_config(g.index))), mode=0o600
        )
        server = f"https://{GUEST_HOST_ADDRESS}:{self._api_port()}"
        g.write_file(
            multus.KUBECONFIG,
            multus.kubeconfig(server, self.cluster.ca.pair.cert_pem(), self._multus_token),
            mode=0o600,
        )
        g.write_file(f"{GUEST_NODE_DIR}/ca.crt", self.cluster.ca.pair.cert.read_bytes())
        g.write_file(f"{GUEST_NODE_DIR}/kubelet.yaml", kubelet_config())
        kubeconfig = self.cluster.kubeconfig_for(f"system:node:{g.name}", ["system:nodes"])
        text = kubeconfig.read_text().replace(
            self.cluster.server, f"https://{GUEST_HOST_ADDRESS}:{self._api_port()}"
        )
        g.write_file(f"{GUEST_NODE_DIR}/kubelet.kubeconfig", text, mode=0o600)
        log.info("%s: containerd and images ready in %.1f s", g.name, time.monotonic() - t0)

    @staticmethod
    def _check(g: Guest, cmd: str, what: str, timeout: float) -> None:
        r = g.run(cmd, timeout=timeout)
        if r.returncode != 0:
            detail = (r.stderr or r.stdout)[-2000:]
            raise NodeError(f"{g.name}: {what} failed (exit {r.returncode}): {detail}")

    def start_kubelet(self, g: Guest) -> None:
        self.kubelets[g.name] = g.start(
            f"exec {GUEST_K8S_BIN}/kubelet --config={GUEST_NODE_DIR}/kubelet.yaml "
            f"--kubeconfig={GUEST_NODE_DIR}/kubelet.kubeconfig "
            f"--hostname-override={g.name} --node-ip={guest_ip(g.index)} "
            "--v=2 >>/var/log/metaroce/kubelet.log 2>&1"
        )

    def stop_kubelet(self, g: Guest) -> None:
        job = self.kubelets.pop(g.name, None)
        if job is not None:
            job.kill()

    def restart_kubelet(self, g: Guest, timeout: float = 180.0) -> None:
        """Restart the kubelet of ``g`` and wait until the new one reports Ready."""
        since = time.time()
        self.stop_kubelet(g)
        self.start_kubelet(g)
        self.wait_ready(timeout, since=since)

    def node_conditions(self, since: float = 0.0) -> dict[str, bool]:
        """Node -> Ready, counting only Ready heartbeats at or after ``since`` (epoch s)."""
        out = self.cluster.kubectl("get", "nodes", "-o", "json").stdout
        ready: dict[str, bool] = {}
        for item in json.loads(out)["items"]:
            name = item["metadata"]["name"]
            conds = item.get("status", {}).get("conditions", [])
            ready[name] = any(
                c["type"] == "Ready"
                and c["status"] == "True"
                and _epoch(c.get("lastHeartbeatTime", "")) >= int(since)
                for c in conds
            )
        return ready

    def wait_ready(self, timeout: float | None = None, since: float = 0.0) -> None:
        deadline = time.monotonic() + (timeout or self.ready_timeout)
        while True:
            ready = self.node_conditions(since)
            if all(ready.get(n) for n in self.names):
                return
            if time.monotonic() > deadline:
                assert self.guests is not None
                tails = "\n".join(
                    f"--- {g.name} kubelet.log\n"
                    + g.run("tail -n 15 /var/log/metaroce/kubelet.log").stdout
                    for g in self.guests
                )
                raise NodeError(f"nodes not Ready after the timeout ({ready}):\n{tails}")
            time.sleep(2)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.guests is not None and self.cluster.workdir is not None:
                self.cluster.kubectl(
                    "delete", "node", *self.names, "--ignore-not-found", "--wait=false", check=False
                )
        if self.guests is not None:
            self.guests.close()
            self.guests = None
        self.remove_host_addresses()
        if self._host_lock is not None:
            os.close(self._host_lock)
            self._host_lock = None

    def remove_host_addresses(self) -> None:
        for addr in self._host_addrs:
            subprocess.run(
                ["ip", "addr", "del", f"{addr}/32", "dev", "lo"], capture_output=True, check=False
            )
        self._host_addrs = []
        _live.discard(self)


def _host_lock_wait() -> float:
    raw = os.environ.get(HOST_LOCK_WAIT_ENV, "")
    if not raw:
        return HOST_LOCK_WAIT_DEFAULT
    try:
        wait = float(raw)
    except ValueError:
        wait = -1.0
    if wait < 0:
        raise NodeError(
            f"{HOST_LOCK_WAIT_ENV}={raw!r}: give the seconds to wait for another run's "
            "real nodes as a number >= 0 (0: fail at once)"
        )
    return wait


def take_host_lock(path: Path, wait_s: float, *, poll_s: float = 2.0) -> int:
    """Hold ``path`` exclusively (flock), waiting up to ``wait_s`` for its holder.

    Returns the open descriptor; closing it releases the lock. The holder's pid and
    command line are written into the file so a waiting run can say whom it waits for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    next_log = 0.0
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            now = time.monotonic()
            holder = Path(path).read_text(errors="replace").strip() or "unknown"
            if now >= deadline:
                os.close(fd)
                raise NodeError(
                    f"{path} is held by another run of real nodes ({holder}) after waiting "
                    f"{wait_s:.0f} s; let it finish or stop it (raise {HOST_LOCK_WAIT_ENV} "
                    "to wait longer)"
                ) from None
            if now >= next_log:
                log.warning(
                    "real nodes: waiting for another run's real nodes to finish (%s), %.0f s left",
                    holder,
                    deadline - now,
                )
                next_log = now + 30.0
            time.sleep(poll_s)
    cmdline = Path("/proc/self/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()}: {cmdline.strip()[:300]}\n".encode(), 0)
    return fd


def _epoch(timestamp: str) -> float:
    """RFC 3339 (as the apiserver writes it) to epoch seconds; 0 when absent."""
    if not timestamp:
        return 0.0
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def _lo_addresses() -> list[tuple[str, str]]:
    """(address/len, label) of the host's lo addresses that this module labelled."""
    out = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "dev", "lo"], capture_output=True, text=True, check=False
    ).stdout
    return labelled_addresses(out)


def labelled_addresses(out: str) -> list[tuple[str, str]]:
    """(address/len, label) of the lines of ``ip -o -4 addr show`` with this module's label."""
    found = []
    for line in out.splitlines():
        fields = line.split()
        # `ip -o` ends the label with the backslash of its line continuation
        labels = [f.rstrip("\\") for f in fields if f.startswith(_LABEL_PREFIX)]
        if labels and len(fields) > 3:
            found.append((fields[3], labels[0]))
    return found


def _sweep_stale_addresses() -> None:
    """Remove the node addresses a killed run left (called holding ``HOST_LOCK``, so no
    live run owns any: the pid in a label may since belong to another process)."""
    for addr, label in _lo_addresses():
        log.warning("real nodes: removing %s (%s), left by a run that was killed", addr, label)
        subprocess.run(["ip", "addr", "del", addr, "dev", "lo"], capture_output=True, check=False)


def leftover_addresses() -> list[str]:
    """Node addresses of this module still on the host's lo (for leak checks)."""
    return [addr for addr, _ in _lo_addresses()]
