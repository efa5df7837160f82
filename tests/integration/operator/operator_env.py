"""Test support for the operator's integration tests and the scale benchmark.

- `OperatorProcess`: the real operator (`python -m metaroce_operator`) as a subprocess,
  on the host or inside the harness's pod network namespace.
- `LoadGenerator`: stands in for the node agents. It watches the agent pods of one
  network and, only once a pod is Running on its node, writes that node's
  MetaRoceNodeState (built with the API models) for the config generation in the
  network's ConfigMap, as a real agent would after applying it, through the agent's own
  `NodeStateWriter` and `KubeClient` (the same requests a real agent makes). Tests can
  make nodes fail, fail their probes, or report reverted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import defaultdict
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from metaroce_agent.kube import KubeClient
from metaroce_agent.report import NodeStateWriter
from metaroce_api import (
    AgentConfig,
    AgentError,
    Device,
    MetaRoceNodeState,
    MetaRoceNodeStateStatus,
    NodeStateSpec,
    ObjectMeta,
    ProbePeer,
    ProbeSummary,
    failpoints,
    nodestate_labels,
    nodestate_name,
)
from metaroce_api import constants as c
from metaroce_harness.cluster import LocalCluster, free_port
from metaroce_harness.polling import wait_for as wait_for  # re-exported for the tests
from metaroce_operator.cli import chart_arguments
from metaroce_operator.kube import KINDS, Kube, load_credentials
from metaroce_operator.render.common import child_name

REPO = Path(__file__).resolve().parents[3]
CRD_DIR = REPO / "crds"
POD = KINDS[("v1", "Pod")]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
NODESTATE = KINDS[(c.API_VERSION, c.NODESTATE_KIND)]
AGENT_IMAGE = "example.com/metaroce-agent:v0.1.0"


def network_manifest(name: str, **spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"nics": {"interfaceNames": ["eth1"]}}
    base.update(spec)
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.NETWORK_KIND,
        "metadata": {"name": name},
        "spec": base,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- the operator


class OperatorProcess:
    """One operator replica as a subprocess; killed by its own pid only."""

    def __init__(
        self,
        args: list[str],
        *,
        kubeconfig: Path,
        log_path: Path,
        identity: str,
        netns: str | None = None,
        host: str = "127.0.0.1",
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.args = args
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.identity = identity
        self.netns = netns
        self.host = host
        self.env = dict(env or {})
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> OperatorProcess:
        argv = [sys.executable, "-m", "metaroce_operator", *self.args]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        # temp files (the webhook's certificate directory) beside the log, in the test's
        # own tmp: an operator killed with SIGKILL cannot remove them itself
        tmp = self.log_path.parent / f"tmp-{self.identity}"
        tmp.mkdir(exist_ok=True)
        env = {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "POD_NAME": self.identity,
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(tmp),
            **self.env,
        }
        if failpoints.ENV not in self.env:  # only the failpoints this process is given
            env.pop(failpoints.ENV, None)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _arg(self, flag: str) -> str | None:
        for arg in self.args:
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
        return None

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        port = self._arg("--metrics-port")
        with urllib.request.urlopen(f"http://{self.host}:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        return sum(
            v
            for (n, ls), v in self.metrics().items()
            if n == name and set(labels.items()) <= set(ls)
        )

    def metric_safe(self, name: str, **labels: str) -> float:
        """`metric`, or -1 while the endpoint does not answer yet."""
        try:
            return self.metric(name, **labels)
        except OSError:
            return -1.0

    def probe(self, path: str) -> int:
        port = self._arg("--health-port")
        try:
            with urllib.request.urlopen(f"http://{self.host}:{port}{path}", timeout=5) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return int(err.code)
        except OSError:
            return 0  # not serving (yet)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if not self.alive():
            return
        self.kill(signal.SIGTERM)
        try:
            self.wait(20)
        except subprocess.TimeoutExpired:
            self.kill(signal.SIGKILL)
            self.wait(10)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def peak_rss_kib(self) -> int:
        """VmHWM of the process (peak resident set)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        return 0


# --------------------------------------------------------------------------- agents' stand-in


class LoadGenerator:
    """Writes NodeStates the way agents would, once each agent pod is Running."""

    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        network: str,
        *,
        transport: str = "rocev2",
        concurrency: int = 16,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.namespace = namespace
        self.network = network
        self.transport = transport
        self.concurrency = concurrency
        self.failing: dict[str, str] = {}
        self.probe_peers: dict[str, list[ProbePeer]] = {}
        self.self_healthy: dict[str, bool] = {}
        self.reverted: set[str] = set()
        self.written: dict[str, tuple[str, int]] = {}
        """node -> (pod uid, config generation) last reported."""
        self.writes = 0
        self.last_write = 0.0
        self.last_running = 0.0
        """When the load generator last saw an agent pod turn Running (monotonic)."""
        self.errors: list[str] = []
        self._pods: dict[str, str] = {}
        self._pod_hashes: dict[str, str | None] = {}
        """node -> the config hash in its agent pod's template (which config it runs)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: asyncio.Queue[str] | None = None
        self._thread = threading.Thread(target=self._main, name="loadgen", daemon=True)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._cm_cache: tuple[float, int | None, str | None] = (0.0, None, None)
        self._writers: dict[tuple[str, str], NodeStateWriter] = {}
        """By (node, agent pod uid): one writer per agent process, as in a real agent."""
        self._node_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    # -- control (from the test's thread) ------------------------------------------------

    def start(self) -> LoadGenerator:
        self._thread.start()
        self._started.wait(10)
        return self

    def stop(self) -> None:
        """Stop writing (idempotent)."""
        self._stop.set()
        self._thread.join(15)

    def rewrite(self, nodes: Iterable[str]) -> None:
        """Report these nodes again (after changing what they report)."""
        assert self._loop is not None and self._queue is not None
        for node in nodes:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, node)

    def fail(self, node: str, error: str | None) -> None:
        if error is None:
            self.failing.pop(node, None)
        else:
            self.failing[node] = error
        self.rewrite([node])

    def revert(self, nodes: Iterable[str]) -> None:
        nodes = list(nodes)
        self.reverted.update(nodes)
        self.rewrite(nodes)

    def reported(self, generation: int | None = None) -> set[str]:
        return {n for n, (_, g) in self.written.items() if generation is None or g == generation}

    # -- the loop -------------------------------------------------------------------------

    def _main(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue = asyncio.Queue()
        kube = Kube(load_credentials(str(self.kubeconfig)), user_agent="metaroce-loadgen")
        self._started.set()
        workers = [asyncio.create_task(self._writer(kube, i)) for i in range(self.concurrency)]
        watcher = asyncio.create_task(self._watch_pods(kube))
        while not self._stop.is_set():
            await asyncio.sleep(0.1)
        watcher.cancel()
        for w in workers:
            w.cancel()
        await asyncio.gather(watcher, *workers, return_exceptions=True)
        await kube.close()

    async def _watch_pods(self, kube: Kube) -> None:
        selector = f"{c.NETWORK_LABEL}={self.network}"
        while True:
            try:
                items, rv = await kube.list_with_version(
                    POD, self.namespace, label_selector=selector
                )
                for pod in items:
                    self._pod_seen(pod)
                async for kind, pod in kube.watch(
                    POD, self.namespace, resource_version=rv, label_selector=selector
                ):
                    if kind == "ERROR":
                        break
                    if kind == "DELETED":
                        continue
                    self._pod_seen(pod)
            except asyncio.CancelledError:
                raise
            except Exception as err:
                self.errors.append(f"watch: {err}")
                await asyncio.sleep(0.5)

    def _pod_seen(self, pod: dict[str, Any]) -> None:
        node = (pod.get("spec") or {}).get("nodeName")
        phase = (pod.get("status") or {}).get("phase")
        if not node or phase != "Running" or pod["metadata"].get("deletionTimestamp"):
            return
        uid = pod["metadata"]["uid"]
        if self._pods.get(node) == uid:
            return
        self._pods[node] = uid
        self._pod_hashes[node] = (pod["metadata"].get("annotations") or {}).get(
            c.CONFIG_HASH_ANNOTATION
        )
        self.last_running = time.monotonic()
        assert self._queue is not None
        self._queue.put_nowait(node)

    async def _config_generation(self, kube: Kube, pod_hash: str | None = None) -> int | None:
        """The ConfigMap's generation, cached for 0.5 s unless the pod runs another config
        (a pod of a rollout seen within 0.5 s of a read of the old ConfigMap would
        otherwise report the old generation forever, as a real agent never does)."""
        at, gen, digest = self._cm_cache
        fresh = time.monotonic() - at < 0.5 and (pod_hash is None or pod_hash == digest)
        if fresh and gen is not None:
            return gen
        cm = await kube.get_or_none(CONFIGMAP, child_name(self.network), self.namespace)
        gen, digest = None, None
        if cm is not None:
            gen = AgentConfig.from_yaml(cm["data"][c.AGENT_CONFIG_KEY]).generation
            digest = (cm["metadata"].get("annotations") or {}).get(c.CONFIG_HASH_ANNOTATION)
        self._cm_cache = (time.monotonic(), gen, digest)
        return gen

    async def _writer(self, kube: Kube, index: int) -> None:
        """One of `concurrency` agents' worth of connections: the agent's own client (one
        kept-alive connection) in its own thread, as each real agent has."""
        assert self._queue is not None
        client = KubeClient.from_kubeconfig(self.kubeconfig)
        pool = ThreadPoolExecutor(1, thread_name_prefix=f"loadgen-{index}")
        try:
            while True:
                node = await self._queue.get()
                try:
                    async with self._node_locks[node]:
                        await self._write(kube, client, pool, node)
                except asyncio.CancelledError:
                    raise
                except Exception as err:
                    self.errors.append(f"{node}: {err}")
                    await asyncio.sleep(0.5)
                    self._queue.put_nowait(node)
        finally:
            pool.shutdown(wait=False)
            client.close()

    def nodestate(self, node: str, generation: int) -> MetaRoceNodeState:
        error = self.failing.get(node)
        peers = self.probe_peers.get(node)
        probe = ProbeSummary(healthy=self.self_healthy.get(node, True), peers=peers or None)
        phase = "Reverted" if node in self.reverted else ("Failed" if error else "Ready")
        status = {
            "phase": phase,
            "configGeneration": generation,
            "agentVersion": "loadgen",
            "inventory": [Device(netdev="eth1", rdma_device="rxe0", rdma_kind="softroce").to_api()],
            "transport": {"mode": self.transport, "ready": not error, "devices": ["rxe0"]},
            "probe": probe.to_api(),
            "reverted": node in self.reverted,
        }
        if error:
            step, _, message = error.partition(": ")
            status["errors"] = [AgentError(step=step, message=message or step).to_api()]
        return MetaRoceNodeState(
            metadata=ObjectMeta(
                name=nodestate_name(self.network, node),
                labels=nodestate_labels(self.network, node),
            ),
            spec=NodeStateSpec(network=self.network, node=node),
            status=MetaRoceNodeStateStatus.model_validate(status),
        )

    async def _write(
        self, kube: Kube, client: KubeClient, pool: ThreadPoolExecutor, node: str
    ) -> None:
        generation = await self._config_generation(kube, self._pod_hashes.get(node))
        if generation is None:
            await asyncio.sleep(0.3)
            assert self._queue is not None
            self._queue.put_nowait(node)
            return
        status = self.nodestate(node, generation).status
        assert status is not None
        pod = self._pods.get(node, "")
        writer = self._writers.get((node, pod))
        if writer is None:  # a new agent pod is a new agent process: it starts afresh
            writer = self._writers[node, pod] = NodeStateWriter(client, self.network, node)
        writer.kube = client  # this worker's connection
        before = writer.requests
        await asyncio.get_running_loop().run_in_executor(pool, writer.write, status)
        self.written[node] = (pod, generation)
        self.writes += writer.requests - before
        self.last_write = time.monotonic()


# --------------------------------------------------------------------------- kubectl helpers


def get_json(cluster: Any, *args: str) -> Any:
    proc = cluster.kubectl("get", *args, "-o", "json", check=False)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout)


def condition(network: Mapping[str, Any] | None, ctype: str) -> dict[str, Any]:
    for cond in ((network or {}).get("status") or {}).get("conditions") or []:
        if cond["type"] == ctype:
            return dict(cond)
    return {}


# --------------------------------------------------------------------------- one test's world


def apply_crds(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
    cluster.kubectl(
        "wait",
        "--for=condition=Established",
        "--timeout=60s",
        f"crd/{c.NETWORK_CRD_NAME}",
        f"crd/{c.NODESTATE_CRD_NAME}",
    )


class OperatorEnv:
    """One test's operators, load generators and networks, cleaned up afterwards."""

    def __init__(self, cluster: LocalCluster, namespace: str, tmp: Path) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.tmp = tmp
        self.operators: list[OperatorProcess] = []
        self.loadgens: list[LoadGenerator] = []
        self.networks: set[str] = set()
        # The agent namespace is labelled for the privileged Pod Security level.
        cluster.kubectl(
            "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=privileged"
        )

    # -- operator --------------------------------------------------------------------------

    def chart_args(self) -> list[str]:
        # Without --agent-cluster-role: these tests run no chart, so they exercise the
        # per-network agent ClusterRole; the chart's shared one is tested in
        # tests/integration/chart (test_chart, test_operator_rbac).
        args = chart_arguments(self.namespace, AGENT_IMAGE)
        return [a for a in args if not a.startswith("--agent-cluster-role=")]

    def operator_args(self, *extra: str) -> list[str]:
        """The chart's arguments, with free ports (several run on one host), plus `extra`."""
        ports = ("--metrics-port", "--health-port", "--webhook-port")
        args = [a for a in self.chart_args() if not a.startswith(ports)]
        return [
            *args,
            f"--metrics-port={free_port()}",
            f"--health-port={free_port()}",
            f"--webhook-port={free_port()}",
            "--housekeeping-interval=3s",
            *extra,
        ]

    def start_operator(
        self,
        *extra: str,
        identity: str = "operator-0",
        env: dict[str, str] | None = None,
        args: list[str] | None = None,
        netns: str | None = None,
        host: str = "127.0.0.1",
        kubeconfig: Path | None = None,
        wait_leader: bool = True,
    ) -> OperatorProcess:
        op = OperatorProcess(
            args if args is not None else self.operator_args(*extra),
            kubeconfig=kubeconfig or self.cluster.kubeconfig,
            log_path=self.tmp / f"{identity}.log",
            identity=identity,
            netns=netns,
            host=host,
            env=env,
        ).start()
        self.operators.append(op)
        if wait_leader:
            wait_for(
                f"{identity} to lead ({op.log_path})",
                lambda: not op.alive() or self.lease_holder() == identity,
                timeout=60,
            )
            assert op.alive(), f"the operator exited: {op.log()[-3000:]}"
        return op

    def lease_holder(self) -> str:
        lease = get_json(self.cluster, "lease", "metaroce-operator", "-n", self.namespace)
        return str(((lease or {}).get("spec") or {}).get("holderIdentity") or "")

    def loadgen(self, network: str, **kw: Any) -> LoadGenerator:
        gen = LoadGenerator(self.cluster.kubeconfig, self.namespace, network, **kw).start()
        self.loadgens.append(gen)
        return gen

    # -- networks ----------------------------------------------------------------------------

    def apply(self, manifest: dict[str, Any]) -> None:
        self.networks.add(manifest["metadata"]["name"])
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(manifest))

    def network(self, name: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = get_json(self.cluster, c.NETWORK_PLURAL, name)
        return result

    def daemonset(self, network: str) -> dict[str, Any] | None:
        result: dict[str, Any] | None = get_json(
            self.cluster, "daemonset", child_name(network), "-n", self.namespace
        )
        return result

    def agent_pods(self, network: str) -> list[dict[str, Any]]:
        found = get_json(
            self.cluster, "pods", "-n", self.namespace, "-l", f"{c.NETWORK_LABEL}={network}"
        )
        return list((found or {}).get("items") or [])

    def nodestates(self, network: str) -> list[dict[str, Any]]:
        found = get_json(self.cluster, c.NODESTATE_PLURAL, "-l", f"{c.NETWORK_LABEL}={network}")
        return list((found or {}).get("items") or [])

    def events(self, network: str) -> list[dict[str, Any]]:
        found = get_json(
            self.cluster,
            "events",
            "-n",
            "default",
            "--field-selector",
            f"involvedObject.name={network},involvedObject.kind={c.NETWORK_KIND}",
        )
        return list((found or {}).get("items") or [])

    def wait_condition(
        self,
        name: str,
        ctype: str,
        status: str,
        *,
        reason: str | None = None,
        generation: int | None = None,
        timeout: float = 90,
    ) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            net = self.network(name)
            cond = condition(net, ctype)
            if cond.get("status") != status or (reason and cond.get("reason") != reason):
                return None
            if (
                generation is not None
                and (net or {}).get("status", {}).get("observedGeneration") != generation
            ):
                return None
            return net

        try:
            result: dict[str, Any] = wait_for(
                f"{name}: {ctype}={status} {reason or ''}", check, timeout=timeout
            )
        except AssertionError:
            net = self.network(name)
            logs = "\n".join(f"--- {op.identity}\n{op.log()[-4000:]}" for op in self.operators)
            raise AssertionError(
                f"{name}: wanted {ctype}={status} {reason or ''} gen={generation}; status now:\n"
                f"{json.dumps((net or {}).get('status'), indent=1)}\n{logs}"
            ) from None
        return result

    # -- teardown --------------------------------------------------------------------------------

    def teardown(self) -> None:
        for name in self.networks:
            self.cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false", check=False)
        deadline = time.monotonic() + 30
        while self.networks and time.monotonic() < deadline:
            self.networks = {n for n in self.networks if self.network(n) is not None}
            time.sleep(0.5)
        for name in self.networks:  # an operator that died left its finalizer: drop it
            self.cluster.kubectl(
                "patch",
                c.NETWORK_PLURAL,
                name,
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
        for gen in self.loadgens:
            gen.stop()
        for op in self.operators:
            op.stop()
        leftover = get_json(self.cluster, c.NODESTATE_PLURAL)
        for item in (leftover or {}).get("items") or []:
            self.cluster.kubectl(
                "delete", c.NODESTATE_PLURAL, item["metadata"]["name"], "--wait=false", check=False
            )
