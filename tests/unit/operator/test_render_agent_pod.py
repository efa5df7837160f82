"""The agent pod's privileges and rollout gates (issue 15 finding 12, issue 16 #15).

- Finding 12: hostPID existed only for revert's /proc/*/fd scan for users of an rxe
  link; revert counts verbs contexts with `rdma res show`, which the kernel does not
  filter by PID namespace (checked on the guests' 6.1 kernel, tests/e2e
  test_agent_faults.py), so the agents run in their own PID namespace.

On b6733c0 (and until this fix) the DaemonSet sets hostPID: true."""

from __future__ import annotations

from typing import Any

from operator_testlib import network

from metaroce_operator.drift import daemonset_drift
from metaroce_operator.render import render_network
from metaroce_operator.settings import RenderSettings


def _daemonset(settings: RenderSettings, **spec: Any) -> dict[str, Any]:
    objs = render_network(network("net", **spec), settings)
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return ds


def test_the_agents_do_not_share_the_host_s_pid_namespace(settings: RenderSettings) -> None:
    ds = _daemonset(settings)
    pod = ds["spec"]["template"]["spec"]
    assert pod.get("hostPID", False) is False, "the agent needs no hostPID (finding 12)"
    assert pod["hostNetwork"] is True  # the NICs live in the host's network namespace
    # Someone adding it back is drift the operator repairs.
    edited = {**ds, "spec": {**ds["spec"], "template": {**ds["spec"]["template"]}}}
    edited["spec"]["template"]["spec"] = {**pod, "hostPID": True}
    assert daemonset_drift(ds, edited) == ["hostPID"]


def test_a_rollout_gates_on_verified_agents_issue_16_15(settings: RenderSettings) -> None:
    """#15: readiness is the agent's /readyz (its plan for the current config applied
    and verified), held for minReadySeconds before an agent counts as available, so
    `maxUnavailable` waits for working agents; /livez restarts a hung agent, after a
    startup probe that lets a slow node (a TCG guest starts Python in ~15 s) come up."""
    ds = _daemonset(settings, agent={"metricsPort": 9479})
    assert ds["spec"]["minReadySeconds"] >= 10
    assert ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"]
    (agent,) = ds["spec"]["template"]["spec"]["containers"]
    ready, live, startup = (agent[k] for k in ("readinessProbe", "livenessProbe", "startupProbe"))
    assert ready["httpGet"] == {"path": "/readyz", "port": 9479}
    assert live["httpGet"] == {"path": "/livez", "port": 9479}
    assert startup["httpGet"] == {"path": "/livez", "port": 9479}
    # the agent binds its metrics port on every address: the kubelet probes the pod IP,
    # which with hostNetwork is the node's
    assert "--metrics-port=9479" in agent["command"]
    assert not any(a.startswith("--metrics-address") for a in agent["command"])
    # a restart must not come from a slow pass: liveness allows minutes, startup ten
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
