"""Fixtures of the operator's integration tests: CRDs, operator processes, load generators.

Networks are cluster-scoped, so every test deletes the networks it made (with its
operator still running, to honour finalizers) before the next test starts its own.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from metaroce_api import constants as c
from metaroce_harness.cluster import LocalCluster, free_port
from metaroce_operator.cli import chart_arguments
from metaroce_operator.render.common import child_name

sys.path.insert(0, str(Path(__file__).parent))

from operator_env import (
    CRD_DIR,
    LoadGenerator,
    OperatorProcess,
    condition,
    get_json,
    wait_for,
)

AGENT_IMAGE = "example.com/metaroce-agent:v0.1.0"


@pytest.fixture(scope="session")
def crds(cluster: LocalCluster) -> None:
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


@pytest.fixture
def env(cluster: LocalCluster, namespace: str, crds: None, tmp_path: Path) -> Iterator[OperatorEnv]:
    e = OperatorEnv(cluster, namespace, tmp_path)
    try:
        yield e
    finally:
        e.teardown()
