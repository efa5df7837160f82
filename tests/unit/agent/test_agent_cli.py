"""The agent loop over a fixture node, the command lines' validation, and doctor."""

from __future__ import annotations

import threading
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import make_config
from fakes import FixtureHost, no_rdma_node, softroce_node

from metaroce_agent.cli import describe_error, doctor_main, run_main
from metaroce_agent.doctor import examine, render
from metaroce_agent.loop import Agent, AgentOptions, ConfigError, load_config


def write_config(path: Path, **kw) -> Path:  # type: ignore[no-untyped-def]
    cfg = make_config(
        nics={"interfaceNames": ["eth0"]},
        transport={"mode": "softroce"},
        driftInterval="1s",
        **kw,
    )
    path.write_text(cfg.to_yaml())
    return path


def test_a_taken_metrics_port_costs_only_the_metrics(tmp_path: Path) -> None:
    """Another network's agent on the node holds the port: this agent still configures
    the node (it must not crash-loop over its /metrics)."""
    import socket

    tree, kernel = softroce_node(tmp_path / "root")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    try:
        opts = AgentOptions(
            config_path=write_config(tmp_path / "agent.yaml"), node_name="node-1", report=False,
            metrics_port=taken.getsockname()[1], metrics_address="127.0.0.1",
        )  # fmt: skip
        agent = Agent(opts, host=FixtureHost(tree.root, runner=kernel))
        agent.serve_metrics()
        assert agent.server is None
        agent.apply_pass()
        assert agent.state.status is not None and agent.state.status.phase == "Ready"
    finally:
        taken.close()


def test_agent_loop_applies_repairs_drift_and_serves_metrics(tmp_path: Path) -> None:
    tree, kernel = softroce_node(tmp_path / "root")
    host = FixtureHost(tree.root, runner=kernel)
    cfg = write_config(tmp_path / "agent.yaml")
    opts = AgentOptions(config_path=cfg, node_name="node-1", report=False, metrics_port=0,
                        metrics_address="127.0.0.1")  # fmt: skip
    agent = Agent(opts, host=host)
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        for _ in range(100):
            if agent.state.status is not None:
                break
            threading.Event().wait(0.05)
        assert agent.state.status is not None and agent.state.status.phase == "Ready"
        tos = "/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos"
        host.write(tos, "0")
        for _ in range(60):
            if agent.state.drift_corrections:
                break
            threading.Event().wait(0.1)
        assert agent.state.drift_corrections == 1 and host.read(tos) == "104"
        assert agent.server is not None
        body = (
            urllib.request.urlopen(f"http://127.0.0.1:{agent.server.port}/metrics", timeout=5)
            .read()
            .decode()
        )
        assert 'metaroce_agent_drift_repairs_total{knob="roce-tos"} 1.0' in body
        assert 'metaroce_rdma_hw_sent_pkts_total{device="rxe_eth0"' in body
    finally:
        agent.stop()
        t.join(10)
    # stopping leaves the node configured
    assert host.exists("/sys/class/infiniband/rxe_eth0") and host.read(tos) == "104"


def test_config_errors_name_field_value_and_fix(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "network: rdma-a\ngeneration: 1\nresourceName: metaroce.io/rdma-a\n"
        "nics: {interfaceNames: [eth0]}\nqos: {data: {dscp: 99}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(bad)
    msg = str(e.value)
    assert "field qos.data.dscp: value 99" in msg and "less than or equal to 63" in msg
    with pytest.raises(ConfigError, match="cannot read it"):
        load_config(tmp_path / "missing.yaml")


def test_cli_flag_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = write_config(tmp_path / "a.yaml")
    assert run_main(["--config", str(cfg), "--metrics-port", "70000"]) == 2
    assert "--metrics-port '70000': not a TCP port (0-65535)" in capsys.readouterr().err
    assert run_main(["--config", str(cfg), "--skip-knob", "tos"]) == 2
    assert "--skip-knob 'tos': not a knob: use one of" in capsys.readouterr().err
    assert run_main(["--config", str(cfg), "--root", str(tmp_path / "nope")]) == 2
    assert "--root" in capsys.readouterr().err
    assert run_main(["--config", str(cfg), "--device-plugin-dir", "device-plugins"]) == 2
    assert "--device-plugin-dir 'device-plugins': give an absolute path" in (
        capsys.readouterr().err
    )


def test_cli_once_prints_the_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the command line over the tests' fixture host (production has no fixture mode)
    from metaroce_agent import loop

    tree, kernel = no_rdma_node(tmp_path / "root")
    monkeypatch.setattr(loop, "Host", lambda root: FixtureHost(tree.root, runner=kernel))
    cfg = make_config(nics={"drivers": ["igb"]})
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    rc = run_main(["--config", str(path), "--no-report", "--once"])
    out = capsys.readouterr().out
    assert rc == 1 and "phase Failed" in out and "allowSoftRoceFallback" in out


def test_doctor_reports_problems_and_fixes(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    ex = examine(n.host, None, "node-1")
    assert not ex.ready
    text = render(ex)
    assert "no RDMA device on this node" in text and "rdma link add" in text
    assert text.rstrip().endswith("(fixes above)")


def test_doctor_with_config_checks_every_knob(node, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from metaroce_agent.engine import Engine, Journal
    from metaroce_agent.plan import make_plan

    n = node(softroce_node)
    cfg = make_config(nics={"interfaceNames": ["eth0"]}, transport={"mode": "softroce"})
    inv = n.inventory()
    Engine(n.host, Journal(n.host, cfg.network)).apply(make_plan(cfg, inv, n.caps(cfg, inv)))
    for uv in n.host.listdir("/sys/class/infiniband_verbs"):
        n.tree.write(f"/dev/infiniband/{uv}", "")
    n.tree.write("/dev/infiniband/rdma_cm", "")
    ex = examine(n.host, cfg, "node-1")
    assert ex.ready, render(ex)
    text = render(ex)
    assert "ok dscp-mark on eth0" in text and "tos 0x68 (dscp 26), priority 3" in text
    assert "default_roce_tos 104" in text and "READY" in text
    n.host.write("/sys/kernel/config/rdma_cm/rxe_eth0/ports/1/default_roce_tos", "0")
    ex = examine(n.host, cfg, "node-1")
    assert not ex.ready and "not in the desired state: roce-tos port1 on rxe_eth0" in render(ex)


def test_doctor_main_exit_codes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from metaroce_agent import host

    tree, kernel = no_rdma_node(tmp_path / "root")
    monkeypatch.setattr(host, "Host", lambda root: FixtureHost(tree.root, runner=kernel))
    assert doctor_main([]) == 1
    assert "NOT READY" in capsys.readouterr().out
    assert doctor_main(["--root", str(tmp_path / "none")]) == 2


class FakeKube:
    """Just enough of KubeClient for the loop: the network object and NodeState writes."""

    def __init__(self, network: dict) -> None:  # type: ignore[type-arg]
        self.network = network
        self.applied: list[tuple[str, dict]] = []  # type: ignore[type-arg]
        self.verbs: list[str] = []

    def get(self, path: str) -> dict | None:  # type: ignore[type-arg]
        return self.network

    def watch(self, path: str, params: dict, timeout: float = 0, **_: object):  # type: ignore[no-untyped-def,type-arg]
        return iter(())  # the network's and the node's (accept=METADATA_WATCH)

    def _record(self, verb: str, path: str, body: dict) -> dict:  # type: ignore[type-arg]
        self.applied.append((path, body))
        self.verbs.append(verb)
        return body

    def create(self, path: str, body: dict, field_manager: str) -> dict:  # type: ignore[type-arg]
        return self._record("create", path, body)  # the NodeState's first report, whole

    def apply(self, path: str, body: dict, field_manager: str) -> dict:  # type: ignore[type-arg]
        return self._record("apply", path, body)  # a take-over

    def merge_patch(self, path: str, patch: dict, field_manager: str) -> dict:  # type: ignore[type-arg]
        return self._record("merge", path, patch)  # later reports: what changed


def test_deleted_network_with_cleanup_is_reverted_and_reported(tmp_path: Path) -> None:
    tree, kernel = softroce_node(tmp_path / "root")
    host = FixtureHost(tree.root, runner=kernel)
    cfg = write_config(tmp_path / "agent.yaml", cleanupOnDelete=True)
    kube = FakeKube({"metadata": {"name": "rdma-a"}, "spec": {"cleanupOnDelete": True}})
    opts = AgentOptions(config_path=cfg, node_name="node-1", metrics_port=None)
    agent = Agent(opts, host=host, kube=kube)  # type: ignore[arg-type]
    t = threading.Thread(target=agent.run, daemon=True)
    t.start()
    try:
        for _ in range(100):
            if agent.state.status is not None and agent.state.status.phase == "Ready":
                break
            threading.Event().wait(0.05)
        assert host.exists("/sys/class/infiniband/rxe_eth0")
        kube.network = {
            "metadata": {"name": "rdma-a", "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"cleanupOnDelete": True},
        }
        for _ in range(100):
            if agent.state.reverted:
                break
            threading.Event().wait(0.05)
        assert agent.state.reverted
    finally:
        agent.stop()
        t.join(10)
    assert not host.exists("/sys/class/infiniband/rxe_eth0")
    # One create with the whole first report, then merge patches of the object itself
    # (the NodeState has no status subresource).
    assert kube.verbs[0] == "create" and set(kube.verbs[1:]) <= {"merge", "apply"}
    assert kube.applied[0][1]["status"]["phase"]
    assert not any(p.endswith("/status") for p, _ in kube.applied)
    statuses = [b["status"] for _, b in kube.applied]
    assert statuses[-1]["phase"] == "Reverted" and statuses[-1]["reverted"] is True
    assert any(s.get("phase") == "Reverting" for s in statuses)


def test_metaroce_networks_probe_over_udp_from_their_netdevs(tmp_path: Path) -> None:
    from metaroce_agent.cli import _maybe_probe
    from metaroce_agent.probe_udp import UdpEndpoint

    tree, kernel = softroce_node(tmp_path / "root")
    host = FixtureHost(tree.root, runner=kernel)
    kube = FakeKube({"metadata": {"name": "rdma-a"}, "spec": {}})
    for mode, endpoint in (("softroce", None), ("metaroce", UdpEndpoint)):
        extra = {"qos": {"profile": "lossy"}} if mode == "metaroce" else {}
        cfg = tmp_path / f"{mode}.yaml"
        cfg.write_text(
            make_config(
                nics={"interfaceNames": ["eth0"]}, transport={"mode": mode}, **extra
            ).to_yaml()
        )
        opts = AgentOptions(config_path=cfg, node_name="node-1", metrics_port=None)
        agent = Agent(opts, host=host, kube=kube)  # type: ignore[arg-type]
        _maybe_probe(agent, opts)
        assert agent.prober is not None, mode
        assert agent.prober.endpoint is endpoint, mode


def test_start_up_errors_keep_their_cause(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 17: an agent that cannot start says what failed and why. ssl's own error for
    a missing CA file names no file; the log names the kubeconfig, the CA and the cause."""
    cfg = write_config(tmp_path / "a.yaml")
    kubeconfig = tmp_path / "kubeconfig"

    def write(cluster: dict[str, str]) -> None:
        kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "clusters": [{"name": "c", "cluster": cluster}],
                    "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "current-context": "x",
                }
            )
        )

    argv = ["--config", str(cfg), "--kubeconfig", str(kubeconfig), "--node-name", "n1"]
    write({"server": "https://10.0.0.1:6443", "certificate-authority": "gone-ca.crt"})
    assert run_main([*argv, "--no-metrics"]) == 1
    err = capsys.readouterr().err
    assert f"cannot start the agent: KubeError: kubeconfig {kubeconfig}: cannot load its CA" in err
    assert "(gone-ca.crt)" in err and "; caused by FileNotFoundError: " in err, err
    write({"certificate-authority": "gone-ca.crt"})
    assert run_main([*argv, "--no-metrics"]) == 1
    assert "its cluster has no server (https://HOST:PORT)" in capsys.readouterr().err


def test_describe_error_follows_causes_and_context() -> None:
    try:
        try:
            {}["server"]
        except KeyError as e:
            raise ValueError("bad kubeconfig") from e
    except ValueError as e:
        assert describe_error(e) == "ValueError: bad kubeconfig; caused by KeyError: 'server'"
    try:
        try:
            raise OSError("disk")
        except OSError:
            raise RuntimeError("while reading") from None
    except RuntimeError as e:
        assert describe_error(e) == "RuntimeError: while reading"
