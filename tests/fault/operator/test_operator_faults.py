"""The operator's fault tier: kill -9 at a failpoint the seed chooses, restart, converge.

Each seed picks (reproducibly, `plan_for`) a phase (rollout, cleanup or certificate
rotation), one or two replicas, which replica dies (the leader, or with two the
follower), the failpoint and the hit count (`METAROCE_FAILPOINTS`, see
api/metaroce_api/failpoints.py). The run drives the phase's scenario against the real
apiserver (agents' NodeStates written by the integration tier's `LoadGenerator`), sees
the victim die by SIGKILL (a failpoint never reached fails the run), restarts it without
failpoints, and checks that everything converged: every node configured or reverted as
the spec says, one of each child, no leaked NodeState, label or taint, the finalizer
released only after the reverted reports, and caBundles that trust the serving
certificate every replica serves. A failure names the seed and the command to rerun it.

CI runs `CI_SEEDS`; more by hand: METAROCE_FAULT_SEEDS=100-119 (or 3,7,12).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import os
import random
import signal
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from operator_env import (
    OperatorEnv,
    OperatorProcess,
    condition,
    get_json,
    network_manifest,
)

from metaroce_api import AgentConfig, failpoints, nodestate_name
from metaroce_api import constants as c
from metaroce_operator.render.common import child_name
from metaroce_operator.webhooks import certs

SEEDS_ENV = "METAROCE_FAULT_SEEDS"
OPERATOR_SOURCE = Path(__file__).resolve().parents[3] / "operator" / "metaroce_operator"
CI_SEEDS = (2, 8, 13, 23, 24, 26)
"""Chosen so CI covers every phase, one and two replicas, and a killed follower
(`test_ci_seeds_cover_every_phase_and_victim` keeps that true if `plan_for` changes)."""

POOL_A = {"matchLabels": {"harness.metaroce.io/pool": "a"}}
NODES_A = ("kwok-a1", "kwok-a2")
ALL_NODES = (*NODES_A, "kwok-b1")
FULLNAME = "metaroce"
SIGKILLED = -signal.SIGKILL
OPERATOR_FLAGS = (
    "--lease-duration=6s",
    "--renew-deadline=4s",
    "--retry-period=1s",
    "--nodestate-grace=3s",
    "--cleanup-timeout=300s",
    "--webhook-cert-check-interval=2s",
)

# failpoint -> the highest hit count its phase's scenario is sure to reach in the leader
LEADER_POINTS: dict[str, dict[str, int]] = {
    "rollout": {
        "rollout.after_finalizer": 1,
        "rollout.after_anchor": 2,  # the create and the spec update
        "rollout.after_child": 8,  # >= 4 children after the anchor, twice
        "rollout.after_children": 2,
        "status.before_write": 3,  # Progressing, Ready, Progressing (gen 2)
    },
    "cleanup": {
        "labels.after_set": 4,  # selected x2, revert, removed
        "taints.after_set": 1,
        "cleanup.waiting": 1,  # kwok-a1 not reverted yet (a restart must not release)
        "cleanup.before_anchor_delete": 1,
        "cleanup.before_finalizer": 1,
        "cleanup.after_finalizer": 1,
        "labels.after_orphan_removed": 1,
        "taints.before_orphan_removed": 1,
        "taints.after_remove": 1,
    },
    "certs": {
        "certs.before_secret": 2,  # the rotation, then the Secret made anew
        "certs.after_secret": 2,
        "certs.after_ca_bundle": 4,  # two configurations, twice
    },
}
# The follower only competes for the lease and reloads the certificate Secret.
FOLLOWER_POINTS: dict[str, tuple[str, int, int]] = {
    "rollout": ("lease.candidate", 2, 6),
    "cleanup": ("lease.candidate", 2, 6),
    "certs": ("certs.after_reload", 2, 2),  # the reload after the Secret is made anew
}


@dataclass(frozen=True)
class FaultPlan:
    seed: int
    phase: str
    replicas: int
    victim: str  # "leader" or "follower"
    point: str
    hit: int

    @property
    def failpoints(self) -> str:
        return f"{self.point}={self.hit}"

    def __str__(self) -> str:
        return (
            f"seed {self.seed}: {self.phase}, {self.replicas} replica(s), kill the "
            f"{self.victim} at {failpoints.ENV}={self.failpoints}"
        )

    @property
    def rerun(self) -> str:
        return (
            f"{SEEDS_ENV}={self.seed} .venv/bin/pytest tests/fault/operator -q -m fault "
            f"-k 'seed{self.seed}-'"
        )


def plan_for(seed: int) -> FaultPlan:
    """What a seed runs (pure; the same seed always gives the same plan)."""
    rng = random.Random(seed)
    phase = rng.choice(sorted(LEADER_POINTS))
    replicas = rng.choice((1, 2))
    victim = rng.choice(("leader", "follower")) if replicas == 2 else "leader"
    if victim == "follower":
        point, low, high = FOLLOWER_POINTS[phase]
    else:
        point = rng.choice(sorted(LEADER_POINTS[phase]))
        low, high = 1, LEADER_POINTS[phase][point]
    return FaultPlan(seed, phase, replicas, victim, point, rng.randint(low, high))


def seeds() -> list[int]:
    """CI_SEEDS, or the seeds METAROCE_FAULT_SEEDS names ("3,7,12" or "100-119")."""
    spec = os.environ.get(SEEDS_ENV, "").strip()
    if not spec:
        return list(CI_SEEDS)
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise pytest.UsageError(f"{SEEDS_ENV}={spec!r}: use seeds like 3,7,12 or 100-119")
        out.extend(range(int(low), int(high) + 1) if sep else [int(low)])
    return out


def test_ci_seeds_cover_every_phase_and_victim() -> None:
    plans = [plan_for(s) for s in CI_SEEDS]
    assert {p.phase for p in plans} == set(LEADER_POINTS), plans
    assert {p.replicas for p in plans} == {1, 2}, plans
    assert {p.victim for p in plans if p.replicas == 2} == {"leader", "follower"}, plans
    # every failpoint named here exists in the operator (a renamed one would never fire)
    names = {n for points in LEADER_POINTS.values() for n in points}
    names |= {point for point, _, _ in FOLLOWER_POINTS.values()}
    source = "\n".join(p.read_text() for p in OPERATOR_SOURCE.rglob("*.py"))
    assert not [n for n in names if f'"{n}"' not in source]


# --------------------------------------------------------------------------- one run


class FaultRun:
    """The replicas of one seed: the victim dies once at its failpoint and is restarted
    (at once, or with two replicas once the survivor leads); every wait watches that."""

    def __init__(self, env: OperatorEnv, plan: FaultPlan) -> None:
        self.env = env
        self.plan = plan
        self.victim: OperatorProcess | None = None
        self.others: list[OperatorProcess] = []
        self.died = False
        self.notes: list[str] = []
        self.cleanups: list[Callable[[OperatorEnv], None]] = []

    def replicas(self) -> list[OperatorProcess]:
        return [
            *self.others,
            *([self.victim] if self.victim and self.victim not in self.others else []),
        ]

    def args(self) -> list[str]:
        return self.env.operator_args(*OPERATOR_FLAGS)

    def start(self) -> None:
        fail = {failpoints.ENV: self.plan.failpoints}
        clean = {failpoints.ENV: ""}
        first_is_victim = self.plan.victim == "leader"
        first = self.env.start_operator(
            args=self.args(),
            identity="operator-0",
            env=fail if first_is_victim else clean,
            wait_leader=False,  # a victim may die at its failpoint right away
        )
        if first_is_victim:
            self.victim = first
        else:
            self.others.append(first)
        self.wait(
            "operator-0 to lead (or die at its failpoint)",
            lambda: self.died or self.env.lease_holder() == "operator-0",
            60,
        )
        if self.plan.replicas == 2:
            second = self.env.start_operator(
                args=self.args(),
                identity="operator-1",
                env=clean if first_is_victim else fail,
                wait_leader=False,
            )
            if first_is_victim:
                self.others.append(second)
            else:
                self.victim = second

    def check(self) -> None:
        """The victim's death (once, by SIGKILL) and restart; nobody else may die."""
        for op in self.others:
            assert op.alive(), f"{op.identity} exited ({op.proc and op.proc.returncode})"
        victim = self.victim
        if victim is None or self.died or victim.alive():
            return
        rc = victim.proc.returncode if victim.proc else None
        assert rc == SIGKILLED, (
            f"{victim.identity} exited with {rc}, not by SIGKILL at its failpoint:\n"
            f"{victim.log()[-3000:]}"
        )
        self.died = True
        self.notes.append(f"{victim.identity} killed at {self.plan.failpoints}")
        survivor = self.others[0] if self.others else None
        if survivor is not None and self.plan.victim == "leader":
            # As in a pod's restart backoff: the survivor takes the expired lease first.
            self._wait_plain(
                f"{survivor.identity} to take over the lease",
                lambda: self.env.lease_holder() == survivor.identity,
                40,
            )
        self.victim = self.env.start_operator(
            args=self.args(),
            identity=victim.identity,
            env={failpoints.ENV: ""},
            wait_leader=survivor is None,
        )
        self.others.append(self.victim)  # from now on it must stay alive too
        self.notes.append(f"{victim.identity} restarted without failpoints")

    def _wait_plain(self, what: str, ready: Callable[[], object], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.3)

    def wait(self, what: str, ready: Callable[[], object], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self.check()
            if ready():
                return
            assert time.monotonic() < deadline, f"timed out ({timeout:.0f} s) waiting for {what}"
            time.sleep(0.3)

    def hold(self, what: str, true: Callable[[], bool], seconds: float) -> None:
        """`true` holds for `seconds` (checked all along, across a kill and restart)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self.check()
            assert true(), f"no longer true: {what}"
            time.sleep(0.3)

    def wait_died(self) -> None:
        self.wait(
            f"the {self.plan.victim} to reach {self.plan.failpoints} and be killed "
            "(a failpoint the scenario never reaches fails the run)",
            lambda: self.died,
            timeout=30,
        )

    def logs(self) -> str:
        ops = {op.identity: op for op in self.replicas()}
        return "\n".join(
            f"--- {op.identity} ({op.log_path})\n{op.log()[-2500:]}" for op in ops.values()
        )


# --------------------------------------------------------------------------- observations


def ready_at(env: OperatorEnv, name: str, generation: int) -> bool:
    net = env.network(name)
    cond = condition(net, c.CONDITION_READY)
    observed = ((net or {}).get("status") or {}).get("observedGeneration")
    return cond.get("status") == "True" and observed == generation


def node_labels(env: OperatorEnv) -> dict[str, dict[str, str]]:
    nodes = get_json(env.cluster, "nodes") or {}
    return {n["metadata"]["name"]: n["metadata"].get("labels") or {} for n in nodes["items"]}


def our_taints(env: OperatorEnv) -> dict[str, str]:
    """node -> the network named by its metaroce taint."""
    out: dict[str, str] = {}
    for node in (get_json(env.cluster, "nodes") or {}).get("items") or []:
        for taint in node.get("spec", {}).get("taints") or []:
            if taint.get("key") == c.UNHEALTHY_TAINT_KEY:
                out[node["metadata"]["name"]] = str(taint.get("value", ""))
    return out


CHILD_KINDS = ("daemonsets", "configmaps", "serviceaccounts", "clusterroles", "clusterrolebindings")


def children(env: OperatorEnv, name: str) -> dict[str, list[str]]:
    """kind -> names of the objects labelled as the network's."""
    out: dict[str, list[str]] = {}
    for kind in CHILD_KINDS:
        scope = [] if kind.startswith("cluster") else ["-n", env.namespace]
        found = get_json(env.cluster, kind, *scope, "-l", f"{c.NETWORK_LABEL}={name}") or {}
        out[kind] = sorted(o["metadata"]["name"] for o in found.get("items") or [])
    return out


def config_generation(env: OperatorEnv, name: str) -> int | None:
    cm = get_json(env.cluster, "configmap", child_name(name), "-n", env.namespace)
    return AgentConfig.from_yaml(cm["data"][c.AGENT_CONFIG_KEY]).generation if cm else None


# --------------------------------------------------------------------------- scenarios


def rollout(run: FaultRun, env: OperatorEnv, name: str) -> None:
    """Create a network, then change its agent config (a second rollout); kill inside."""
    spec: dict[str, Any] = {"nodeSelector": POOL_A, "cleanupOnDelete": True}
    gen = env.loadgen(name)
    env.apply(network_manifest(name, **spec))
    run.wait("Ready at generation 1", lambda: ready_at(env, name, 1), 120)
    env.apply(network_manifest(name, **spec, agent={"logLevel": "debug"}))
    run.wait("Ready at generation 2", lambda: ready_at(env, name, 2), 150)
    run.wait_died()

    run.wait("Ready at generation 2 after the restart", lambda: ready_at(env, name, 2), 120)
    net = env.network(name) or {}
    assert net["metadata"].get("finalizers") == [c.CLEANUP_FINALIZER], net["metadata"]
    assert net["status"]["nodes"]["configured"] == 2, net["status"]
    found = children(env, name)
    assert all(found[kind] == [child_name(name)] for kind in CHILD_KINDS), found
    config_gen = config_generation(env, name)
    states = env.nodestates(name)
    assert sorted(s["spec"]["node"] for s in states) == list(NODES_A), states
    for state in states:
        assert state["metadata"]["name"] == nodestate_name(name, state["spec"]["node"])
        assert state["status"]["phase"] == "Ready", state["status"]
        assert state["status"]["configGeneration"] == config_gen, (state["status"], config_gen)
    ds = env.daemonset(name) or {}
    cm = get_json(env.cluster, "configmap", child_name(name), "-n", env.namespace) or {}
    template_hash = ds["spec"]["template"]["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION]
    assert template_hash == cm["metadata"]["annotations"][c.CONFIG_HASH_ANNOTATION]
    labels = node_labels(env)
    label = c.node_label(name)
    assert {n: labels[n].get(label) for n in ALL_NODES} == {
        "kwok-a1": c.NODE_SELECTED,
        "kwok-a2": c.NODE_SELECTED,
        "kwok-b1": None,
    }

    # Tidy up through the operator (cleanupOnDelete): the network goes once both revert.
    env.cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false")
    gen.revert(NODES_A)
    run.wait("the network released", lambda: env.network(name) is None, 60)
    env.networks.discard(name)


def cleanup(run: FaultRun, env: OperatorEnv, name: str) -> None:
    """A node leaves the selector (asked to revert), then the network is deleted with
    cleanupOnDelete and its last node reports reverted later; a node carries its taint."""
    label = c.node_label(name)
    health = {"action": "taint", "maxTaintedFraction": 1.0}
    gen = env.loadgen(name)
    gen.self_healthy["kwok-a1"] = False  # its own probes fail: the network taints it
    env.apply(network_manifest(name, nodeSelector=POOL_A, cleanupOnDelete=True, health=health))
    run.wait(
        "both nodes reporting and kwok-a1 tainted",
        lambda: gen.reported() >= set(NODES_A) and our_taints(env) == {"kwok-a1": name},
        120,
    )
    only_a1 = {"matchLabels": {"kubernetes.io/hostname": "kwok-a1"}}
    env.apply(network_manifest(name, nodeSelector=only_a1, cleanupOnDelete=True, health=health))
    run.wait(
        "kwok-a2 asked to revert (its label)",
        lambda: node_labels(env)["kwok-a2"].get(label) == c.NODE_REVERT,
    )
    run.hold(
        "kwok-a2 keeps its label (and agent) until it reports reverted",
        lambda: node_labels(env)["kwok-a2"].get(label) == c.NODE_REVERT,
        2,
    )
    gen.revert(["kwok-a2"])
    run.wait(
        "kwok-a2's label removed after its reverted report",
        lambda: label not in node_labels(env)["kwok-a2"],
    )

    env.cluster.kubectl("delete", c.NETWORK_PLURAL, name, "--wait=false")
    run.hold(
        "the network stays while kwok-a1 has not reported reverted",
        lambda: env.network(name) is not None,
        4,
    )
    gen.revert(["kwok-a1"])
    run.wait("the network released after kwok-a1's report", lambda: env.network(name) is None, 60)
    env.networks.discard(name)
    run.wait_died()

    run.wait("its NodeStates deleted", lambda: not env.nodestates(name), 60)
    run.wait(
        "its node labels removed",
        lambda: not any(label in labels for labels in node_labels(env).values()),
        60,
    )
    run.wait("its taint removed", lambda: name not in our_taints(env).values(), 60)
    run.wait(
        "its children collected",
        lambda: not any(children(env, name).values()),
        90,
    )


def _webhook_configurations(env: OperatorEnv) -> Iterator[dict[str, Any]]:
    """The chart's two configurations, calling nothing that exists (objects nobody labels)."""
    hook = {
        "clientConfig": {"url": "https://127.0.0.1:9/never"},
        "rules": [
            {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
             "resources": ["configmaps"]}
        ],
        "objectSelector": {"matchLabels": {"fault.metaroce.io/never": "called"}},
        "failurePolicy": "Ignore",
        "sideEffects": "None",
        "admissionReviewVersions": ["v1"],
        "timeoutSeconds": 1,
    }  # fmt: skip
    for kind, template in (
        ("MutatingWebhookConfiguration", c.POD_WEBHOOK_CONFIG_TEMPLATE),
        ("ValidatingWebhookConfiguration", c.NETWORK_WEBHOOK_CONFIG_TEMPLATE),
    ):
        yield {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": kind,
            "metadata": {"name": template.format(fullname=FULLNAME)},
            "webhooks": [
                {**hook, "name": f"first.{kind.lower()}.fault.metaroce.io"},
                {**hook, "name": f"second.{kind.lower()}.fault.metaroce.io"},
            ],
        }


def _secret(env: OperatorEnv) -> certs.CertBundle | None:
    name = c.WEBHOOK_CERT_SECRET_TEMPLATE.format(fullname=FULLNAME)
    body = get_json(env.cluster, "secret", name, "-n", env.namespace)
    return certs.CertBundle.from_secret_data((body or {}).get("data")) if body else None


def _ca_bundles(env: OperatorEnv) -> list[bytes]:
    out = []
    for kind, template in (
        ("mutatingwebhookconfiguration", c.POD_WEBHOOK_CONFIG_TEMPLATE),
        ("validatingwebhookconfiguration", c.NETWORK_WEBHOOK_CONFIG_TEMPLATE),
    ):
        body = get_json(env.cluster, kind, template.format(fullname=FULLNAME)) or {}
        for hook in body.get("webhooks") or []:
            out.append(base64.b64decode(hook["clientConfig"].get("caBundle") or ""))
    return out


def _served_cert(op: OperatorProcess) -> bytes | None:
    """The DER certificate the replica's webhook port serves now."""
    port = int(op._arg("--webhook-port") or 0)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=3) as sock,
            context.wrap_socket(sock) as tls,
        ):
            return tls.getpeercert(binary_form=True)
    except OSError:
        return None


def bundles_trust_served(env: OperatorEnv, replicas: list[OperatorProcess], cas: int) -> bool:
    """Every caBundle is the Secret's ca.crt (`cas` CAs), which signed its serving
    certificate, and every replica serves that certificate."""
    bundle = _secret(env)
    if bundle is None or len(bundle.cas()) != cas:
        return False
    if any(b != bundle.ca_bundle for b in _ca_bundles(env)):
        return False
    serving = bundle.serving_cert()
    now = dt.datetime.now(dt.UTC)
    if not (serving.not_valid_before_utc <= now < serving.not_valid_after_utc):
        return False
    if not any(_issued_by(serving, ca) for ca in bundle.cas()):
        return False
    der = serving.public_bytes(serialization.Encoding.DER)
    return all(_served_cert(op) == der for op in replicas if op.alive())


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
    except Exception:
        return False
    return True


def rotation(run: FaultRun, env: OperatorEnv, name: str) -> None:
    """The Secret's CA is near its end and the serving certificate expiring: the leader
    adds a new CA, re-issues, publishes both caBundles; then the Secret is lost and made
    anew. Kill inside."""
    del name
    for config in _webhook_configurations(env):
        env.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(config))
    run.cleanups.append(_delete_webhook_configurations)
    service = c.WEBHOOK_SERVICE_TEMPLATE.format(fullname=FULLNAME)
    dns = certs.service_dns_names(service, env.namespace)
    ca, ca_key = certs.make_ca(days=100)  # inside the 2-year renewal window
    cert, key = certs.issue_serving_cert(ca, ca_key, dns, days=5)  # inside 30 days
    secret_name = c.WEBHOOK_CERT_SECRET_TEMPLATE.format(fullname=FULLNAME)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": secret_name, "namespace": env.namespace},
        "type": certs.SECRET_TYPE,
        "data": certs.CertBundle(cert, key, ca, ca_key).secret_data(),
    }
    env.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(secret))
    run.start()
    run.wait(
        "the rotated bundle (new and old CA) published and served",
        lambda: bundles_trust_served(env, run.replicas(), cas=2),
        60,
    )
    env.cluster.kubectl("delete", "secret", secret_name, "-n", env.namespace)
    run.wait(
        "a new Secret (one CA) published and served",
        lambda: bundles_trust_served(env, run.replicas(), cas=1),
        60,
    )
    run.wait_died()
    run.wait(
        "after the restart: caBundles trust what every replica serves",
        lambda: bundles_trust_served(env, run.replicas(), cas=1),
        60,
    )


def _delete_webhook_configurations(env: OperatorEnv) -> None:
    for config in _webhook_configurations(env):
        env.cluster.kubectl(
            "delete", config["kind"].lower(), config["metadata"]["name"], check=False
        )


def state(env: OperatorEnv) -> str:
    """What the cluster holds, for a failure message."""
    out = []
    for name in sorted(env.networks):
        net = env.network(name) or {}
        ds = env.daemonset(name) or {}
        out.append(f"network {name}: {json.dumps(net.get('status'), indent=1)}")
        out.append(f"  finalizers {net.get('metadata', {}).get('finalizers')}")
        out.append(f"  DaemonSet status {ds.get('status')}")
        for s in env.nodestates(name):
            out.append(
                f"  NodeState {s['metadata']['name']}: {s.get('status', {}).get('phase')} "
                f"gen {s.get('status', {}).get('configGeneration')}"
            )
    return "\n".join(out)


SCENARIOS: dict[str, Callable[[FaultRun, OperatorEnv, str], None]] = {
    "rollout": rollout,
    "cleanup": cleanup,
    "certs": rotation,
}


@pytest.mark.parametrize(
    "plan",
    [plan_for(s) for s in seeds()],
    ids=lambda p: f"seed{p.seed}-{p.phase}-{p.victim}-{p.failpoints}",
)
def test_killed_at_a_failpoint_converges(env: OperatorEnv, plan: FaultPlan) -> None:
    run = FaultRun(env, plan)
    started = time.monotonic()
    try:
        if plan.phase != "certs":
            run.start()
        SCENARIOS[plan.phase](run, env, f"{plan.phase[:4]}-{plan.seed}")
        run.check()
    except AssertionError as err:
        raise AssertionError(
            f"fault {plan} did not converge: {err}\n"
            f"what happened: {'; '.join(run.notes) or 'no kill'}\n"
            f"rerun: {plan.rerun}\n{run.logs()}\n{state(env)}"
        ) from None
    finally:
        for tidy in run.cleanups:
            tidy(env)
    print(
        f"[fault] {plan}: {'; '.join(run.notes)}; converged in {time.monotonic() - started:.1f} s"
    )
