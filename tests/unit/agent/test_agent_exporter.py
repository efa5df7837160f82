"""The counter exporter over fixture trees (mlx5 and rxe naming, missing and bad files)."""

from __future__ import annotations

from fakes import mellanox_node, softroce_node
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from metaroce_agent.exporter import AgentMetrics, RdmaCounterCollector


def scrape(collector: RdmaCounterCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What /metrics serves (the agent's registry, then the collector's own rendering)."""
    metrics = AgentMetrics("rdma-a", "node-1")
    metrics.add_rdma_collector(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_mlx5_port_and_hw_counters(node) -> None:  # type: ignore[no-untyped-def]
    n = node(mellanox_node)
    n.tree.rdma("mlx5_9", netdev="eno1", counter_value=7, device_hw_counters=["dev_counter"])
    m = scrape(RdmaCounterCollector(n.host, "rdma-a"))
    labels, value = m["metaroce_rdma_port_port_xmit_data_total"][1]
    assert labels == {"device": "mlx5_9", "port": "1", "netdev": "eno1", "network": "rdma-a"}
    assert value == 7
    assert "metaroce_rdma_hw_np_cnp_sent_total" in m
    assert m["metaroce_rdma_hw_dev_counter_total"][0][0]["port"] == ""
    assert not any("lifespan" in k for k in m)


def test_rxe_without_counters_dir_and_unreadable_files(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True, counter_value=3)
    hw = n.tree.p("/sys/class/infiniband/rxe0/ports/1/hw_counters")
    (hw / "garbage").write_text("not a number\n")
    (hw / "subdir").mkdir()
    (hw / "rcvd_pkts").unlink()
    (hw / "rcvd_pkts").mkdir()  # unreadable as a file
    m = scrape(RdmaCounterCollector(n.host, "rdma-a", devices=lambda: [("rxe0", "eth0")]))
    assert m["metaroce_rdma_hw_sent_pkts_total"] == [
        ({"device": "rxe0", "port": "1", "netdev": "eth0", "network": "rdma-a"}, 3.0)
    ]
    assert not any(k.startswith("metaroce_rdma_port_") for k in m)
    assert "metaroce_rdma_hw_garbage_total" not in m and "metaroce_rdma_hw_rcvd_pkts_total" not in m


def test_agent_metrics_render(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    metrics = AgentMetrics("rdma-a", "node-1")
    metrics.add_rdma_collector(RdmaCounterCollector(n.host, "rdma-a", devices=lambda: []))
    metrics.drift_repairs.labels(knob="pfc").inc()
    metrics.probe_latency.labels(peer="node-2", quantile="0.99").set(42)
    text = generate_latest(metrics.registry).decode()
    assert 'metaroce_agent_drift_repairs_total{knob="pfc"} 1.0' in text
    assert 'metaroce_probe_latency_microseconds{peer="node-2",quantile="0.99"} 42.0' in text
    assert "metaroce_agent_apply_duration_seconds_bucket" in text


def test_device_plugin_state_at_scrape_time() -> None:
    """Not registered (allocatable 0) and unhealthy units are visible; no plugin, no rows."""
    from metaroce_agent.deviceplugin.plugin import PluginStatus

    state: list[tuple[str, PluginStatus] | None] = [None]
    metrics = AgentMetrics("rdma-a", "node-1")
    metrics.add_plugin_source(lambda: state[0])

    def read() -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for fam in text_string_to_metric_families(metrics.render().decode()):
            for s in fam.samples:
                out.setdefault(s.name, []).append((s.labels, s.value))
        return out

    assert not any("device_plugin" in name for name in read())
    state[0] = (
        "metaroce.io/rdma-a",
        PluginStatus(
            registered=False, registrations=2, devices=["rxe0"], healthy_units=3, total_units=4
        ),
    )
    m = read()
    labels = {"network": "rdma-a", "resource": "metaroce.io/rdma-a"}
    assert m["metaroce_agent_device_plugin_registered"] == [(labels, 0.0)]
    assert m["metaroce_agent_device_plugin_registrations_total"] == [(labels, 2.0)]
    units = {s[0]["health"]: s[1] for s in m["metaroce_agent_device_plugin_units"]}
    assert units == {"healthy": 3.0, "unhealthy": 1.0}
