"""`metaroce status`, `doctor --node` and `test-rdma` as pure functions (issue 17): the
report of a network from its objects, the agent pod and command the doctor runs in, and
test-rdma's plan, pod manifests and perftest parsing. The status command against a real
apiserver is in tests/integration/test_cli_status.py, test-rdma between real kubelet
nodes in tests/e2e/nodes/test_agents.py (test_2b)."""

from __future__ import annotations

import subprocess
from typing import Any

import pytest

from metaroce_api import constants as c
from metaroce_cli import doctor, status, test_rdma
from metaroce_cli.main import main as metaroce

# --- status ---------------------------------------------------------------------------------


def _network(name: str = "backend", ready: str = "False", **status_extra: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "generation": 2},
        "spec": {"transport": {"mode": "rocev2"}},
        "status": {
            "observedGeneration": 2,
            "nodes": {"desired": 2, "configured": 1, "healthy": 1, "failed": 1},
            "conditions": [
                {"type": "Ready", "status": ready, "reason": "NodesFailed", "message": "1 failed"},
                {"type": "Degraded", "status": "True", "reason": "NodesFailed", "message": "x"},
            ],
            **status_extra,
        },
    }


def _state(node: str, phase: str, errors: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": f"backend.{node}"},
        "spec": {"network": "backend", "node": node},
        "status": {
            "phase": phase,
            "transport": {"mode": "rocev2", "ready": phase == "Ready"},
            "inventory": [{"netdev": "ens1f0", "rdmaDevice": "mlx5_0", "portState": "ACTIVE"}],
            "probe": {"healthy": True},
            "errors": errors or [],
        },
    }


def test_status_names_failing_steps_and_their_fixes() -> None:
    lines = status.network_report(
        _network(failingNodes=[{"node": "gpu-2", "reason": "ApplyFailed"},
                               {"node": "gpu-3", "reason": "NoReport", "message": "silent"}]),
        [_state("gpu-1", "Ready"),
         _state("gpu-2", "Failed", [{"step": "apply pfc", "message": "dcb: not supported"},
                                    {"step": "retry", "message": "next attempt in 8 s"}])],
    )  # fmt: skip
    text = "\n".join(lines)
    assert lines[0].startswith("network backend: transport rocev2, nodes desired 2")
    assert "Ready=False NodesFailed: 1 failed" in text
    assert f"fix: {status.CONDITION_FIXES[c.REASON_NODES_FAILED]}" in text
    assert "gpu-1" in text and "mlx5_0/ens1f0 ACTIVE" in text
    assert "apply pfc: dcb: not supported" in text
    assert "rolled back to its last verified state: `metaroce doctor --node gpu-2`" in text
    # a note is shown, but gets no fix of its own
    retry = lines.index("    retry: next attempt in 8 s")
    assert not lines[retry + 1].startswith("    fix:")
    # a failing node without a NodeState is still named
    assert "gpu-3" in text and "NoReport: silent" in text


def test_status_of_a_ready_network_has_no_fixes() -> None:
    net = _network(ready="True")
    net["status"]["conditions"] = [
        {"type": "Ready", "status": "True", "reason": "Reconciled", "message": ""},
        {"type": "Degraded", "status": "False", "reason": "AsExpected", "message": ""},
    ]
    text = "\n".join(status.network_report(net, [_state("gpu-1", "Ready")]))
    assert "fix:" not in text
    assert status.is_ready(net)


def test_status_says_when_the_operator_is_behind_or_absent() -> None:
    net = {"metadata": {"name": "n", "generation": 3}, "spec": {}}
    text = "\n".join(status.network_report(net, []))
    assert "has not seen generation 3" in text and "no conditions yet" in text
    assert "no NodeState yet" in text


def test_status_overview() -> None:
    lines = status.overview([_network("b"), _network("a", ready="True")])
    assert lines[1].split()[:3] == ["a", "True", "1/2"]
    assert lines[2].split()[-1] == "NodesFailed"
    assert "no MetaRoceNetwork" in status.overview([])[0]


def test_step_fix_for_the_primary_interface_guard() -> None:
    fix = status.step_fix("nics.primary", "n1")
    assert fix is not None and "allowPrimaryInterface" in fix


def test_status_without_a_cluster_says_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    assert metaroce(["status"]) == 2
    assert "no kubeconfig" in capsys.readouterr().out


# --- doctor --node --------------------------------------------------------------------------


def _agent_pod(network: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"metaroce-agent-{network}-x1",
            "namespace": "rdma",
            "labels": {c.NETWORK_LABEL: network, c.COMPONENT_LABEL: c.COMPONENT_AGENT},
        }
    }


def test_doctor_runs_in_the_agent_pod_with_its_config() -> None:
    pods = {"items": [_agent_pod("b"), _agent_pod("a")]}
    assert [p["metadata"]["labels"][c.NETWORK_LABEL] for p in doctor.agent_pods(pods, None)] == [
        "a",
        "b",
    ]
    (pod,) = doctor.agent_pods(pods, "b")
    assert doctor.exec_argv(pod, as_json=True) == [
        "exec", "-n", "rdma", "metaroce-agent-b-x1", "-c", "agent", "--",
        "metaroce", "doctor", "--config", "/etc/metaroce/agent.yaml", "--require-pyverbs", "--json",
    ]  # fmt: skip


def test_doctor_without_node_stays_local() -> None:
    assert doctor.wants_remote(["--node", "n1"]) and doctor.wants_remote(["--node=n1"])
    assert not doctor.wants_remote(["--node-name", "n1", "--json"])


# --- test-rdma ------------------------------------------------------------------------------

NETWORKS = [
    {"metadata": {"name": "backend"}, "spec": {"transport": {"mode": "rocev2"}}},
    {"metadata": {"name": "mr"}, "spec": {"transport": {"mode": "metaroce"}}},
]
BW_OUT = """\
---------------------------------------------------------------------------------------
 #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]
 65536      21380            0.00               3.74 		   0.007131
---------------------------------------------------------------------------------------
"""
LAT_OUT = """\
---------------------------------------------------------------------------------------
 #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]
 2       1000          180.12         1210.50      230.40     	       251.33      	60.10   		610.00  		1100.20
---------------------------------------------------------------------------------------
"""  # noqa: E501


def _plan(**kw: Any) -> test_rdma.TestPlan:
    return test_rdma.make_plan("gpu-1,gpu-2", "backend", NETWORKS, image="reg/rdma-test:1",
                               run_id="abc123", **kw)  # fmt: skip


def test_plan_checks_nodes_and_network() -> None:
    plan = _plan()
    assert (plan.client_node, plan.server_node) == ("gpu-1", "gpu-2")
    with pytest.raises(test_rdma.PlanError, match="--nodes='gpu-1'"):
        test_rdma.make_plan("gpu-1", "backend", NETWORKS, image="i")
    with pytest.raises(test_rdma.PlanError, match="two different nodes"):
        test_rdma.make_plan("a,a", "backend", NETWORKS, image="i")
    with pytest.raises(test_rdma.PlanError, match=r"several networks exist .*backend, mr"):
        test_rdma.make_plan("a,b", None, NETWORKS, image="i")
    with pytest.raises(test_rdma.PlanError, match=r"no such MetaRoceNetwork .*there are"):
        test_rdma.make_plan("a,b", "nope", NETWORKS, image="i")
    assert test_rdma.make_plan("a,b", "mr", NETWORKS, image="i").transport == "metaroce"
    assert plan.transport == "verbs"
    assert test_rdma.make_plan("a,b", None, NETWORKS[:1], image="i").network == "backend"


def test_pods_are_annotated_pinned_and_bounded() -> None:
    plan = _plan()
    server = test_rdma.pod_manifest(plan, "server")
    client = test_rdma.pod_manifest(plan, "client", "10.0.0.7")
    assert server["metadata"]["annotations"] == {c.NETWORKS_ANNOTATION: "backend"}
    assert server["metadata"]["name"] == "test-rdma-abc123-server"
    for pod, node in ((server, "gpu-2"), (client, "gpu-1")):
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]  # fmt: skip
        assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                           "values": [node]}]}]  # fmt: skip
        assert pod["spec"]["restartPolicy"] == "Never"
        assert pod["spec"]["activeDeadlineSeconds"] == 240
        # nothing RDMA-related by hand: the admission adds the device, IPC_LOCK and NCCL_*
        (container,) = pod["spec"]["containers"]
        assert "resources" not in container and "securityContext" not in container
        assert container["image"] == "reg/rdma-test:1"
    assert client["spec"]["containers"][0]["env"] == [{"name": "SERVER_IP", "value": "10.0.0.7"}]
    for pod in (server, client):  # the scripts are valid shell
        script = pod["spec"]["containers"][0]["command"][2]
        assert "@" not in script.replace("$@", "")
        subprocess.run(["sh", "-n", "-c", script], check=True)


def test_perftest_output_is_parsed() -> None:
    assert test_rdma.parse_bandwidth(BW_OUT) == 3.74
    assert test_rdma.parse_latency(LAT_OUT) == {
        "min": 180.12, "typical": 230.40, "avg": 251.33, "p99": 610.00,
    }  # fmt: skip
    log = f"device rxe0, flags -d rxe0 -F\n== bandwidth\n{BW_OUT}== latency\n{LAT_OUT}== done\n"
    bw, lat = test_rdma.client_results(log)
    assert bw == 3.74 and lat is not None and lat["typical"] == 230.40
    assert test_rdma.client_results("== bandwidth\nCouldn't connect to 10.0.0.7:18515\n") == (
        None,
        None,
    )
    lines = test_rdma.report(_plan(), bw, lat)
    assert "3.74 Gb/s" in lines[1] and "typical 230.40 us" in lines[2]
    assert "FAILED" in "\n".join(test_rdma.report(_plan(), None, None))


def test_pods_that_cannot_run_say_why() -> None:
    unschedulable = {"status": {"conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
        "message": "0/3 nodes are available: 1 Insufficient metaroce.io/backend."}]}}  # fmt: skip
    why = test_rdma.pending_reason(unschedulable)
    assert why is not None and "metaroce status" in why
    pull = {"status": {"containerStatuses": [{"state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "not found"}}}]}}  # fmt: skip
    why = test_rdma.pending_reason(pull)
    assert why is not None and "--image" in why
    assert test_rdma.pending_reason({"status": {"phase": "Pending"}}) is None


def test_usage_lists_the_cluster_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert metaroce([]) == 0
    user = capsys.readouterr().out.split("developer commands")[0]
    for word in ("status", "doctor", "test-rdma"):
        assert word in user


def test_extra_perftest_flags_reach_both_sides_and_nothing_else() -> None:
    plan = _plan(perftest_flags="-s 65536 -t 1")
    for role in ("server", "client"):
        script = test_rdma.pod_manifest(plan, role, "10.0.0.7")["spec"]["containers"][0]
        assert 'flags="$flags -s 65536 -t 1"' in script["command"][2]
    with pytest.raises(test_rdma.PlanError, match="--perftest-flags"):
        _plan(perftest_flags="-s 1; rm -rf /")


PERF_BW = (
    '{"mode":"bw","size":1048576,"messages":114,"bytes":119537664,"seconds":1.11,'
    '"goodput_gbps":0.857926,"goodput_mbit":857.926,"packets_sent":85360,"retransmits":696,'
    '"spurious_retransmits":772,"lat_p50_us":0.00,"lat_p99_us":0.00,'
    '"paths":[{"src_port":34000},{"src_port":34001}]}'
)
PERF_LAT = (
    '{"mode":"lat","size":8,"messages":1000,"bytes":8000,"seconds":0.2,"goodput_gbps":0.0,'
    '"goodput_mbit":0.3,"packets_sent":2000,"retransmits":0,"spurious_retransmits":0,'
    '"lat_p50_us":61.50,"lat_p99_us":140.25,"paths":[]}'
)


def test_a_metaroce_network_is_tested_with_the_installed_metaroce_perf() -> None:
    plan = test_rdma.make_plan("gpu-1,gpu-2", "mr", NETWORKS, image="reg/rdma-test:1",
                               run_id="abc123", perf_flags="--size 65536")  # fmt: skip
    server = test_rdma.pod_manifest(plan, "server")
    client = test_rdma.pod_manifest(plan, "client", "udp://10.0.0.7:20000")
    assert server["metadata"]["annotations"] == {c.NETWORKS_ANNOTATION: "mr"}
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert server["spec"]["containers"][0]["env"] == [pod_ip]
    assert client["spec"]["containers"][0]["env"] == [
        pod_ip, {"name": "SERVER_URL", "value": "udp://10.0.0.7:20000"}]  # fmt: skip
    s_script = server["spec"]["containers"][0]["command"][2]
    c_script = client["spec"]["containers"][0]["command"][2]
    assert "/opt/metaroce-transport/bin/metaroce-perf" in s_script
    assert "server --sessions 2" in s_script and 'addr=$POD_IP"' in s_script
    assert "--mode bw --duration 3 --json --size 65536" in c_script
    assert "--mode lat --size 8 --iters 1000" in c_script
    assert "ib_write_bw" not in c_script
    for script in (s_script, c_script):
        assert "@" not in script.replace("$@", "")
        subprocess.run(["sh", "-n", "-c", script], check=True)
    # the wrong tool's flags are refused, naming the right flag
    with pytest.raises(test_rdma.PlanError, match=r"--perftest-flags=.*--perf-flags"):
        test_rdma.make_plan("a,b", "mr", NETWORKS, image="i", perftest_flags="-s 65536")
    with pytest.raises(test_rdma.PlanError, match=r"--perf-flags=.*--perftest-flags"):
        test_rdma.make_plan("a,b", "backend", NETWORKS, image="i", perf_flags="--size 1")
    with pytest.raises(test_rdma.PlanError, match="--perf-flags"):
        test_rdma.make_plan("a,b", "mr", NETWORKS, image="i", perf_flags="--size 1; reboot")


def test_metaroce_perf_output_is_parsed_and_reported() -> None:
    assert (
        test_rdma.listening_url(
            "metaroce-perf, config ports=20000-20099\n"
            "metaroce-perf server listening on udp://10.0.0.7:20003\n"
        )
        == "udp://10.0.0.7:20003"
    )
    assert test_rdma.listening_url("no perf here") is None
    log = f"metaroce-perf, config x\n== bandwidth\n{PERF_BW}\n== latency\n{PERF_LAT}\n== done\n"
    bw, lat = test_rdma.perf_results(log)
    assert bw is not None and bw["retransmits"] == 696
    assert lat is not None and lat["lat_p50_us"] == 61.5
    plan = test_rdma.make_plan("gpu-1,gpu-2", "mr", NETWORKS, image="i")
    lines = test_rdma.perf_report(plan, bw, lat)
    assert "0.858 Gb/s, 696 retransmits (772 spurious) of 85360 packets over 2 paths" in lines[1]
    assert "p50 61.50 us, p99 140.25 us" in lines[2]
    failed = test_rdma.perf_results("== bandwidth\nmetaroce-perf: connect timed out\n")
    assert failed == (None, None)
    assert "FAILED" in test_rdma.perf_report(plan, *failed)[1]
