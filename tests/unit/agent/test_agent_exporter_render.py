"""The counters as production serves them (`AgentMetrics.render`, the /metrics body):
odd files are skipped there too, and label values are escaped (bench items of issue 15).

Before this fix the odd-file tests went through `collect()`, which production does not
use, and `render()` wrote label values unescaped: a netdev named with a quote or a
backslash broke the whole exposition."""

from __future__ import annotations

from fakes import softroce_node
from prometheus_client.parser import text_string_to_metric_families

from metaroce_agent.exporter import AgentMetrics, RdmaCounterCollector


def served(collector: RdmaCounterCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    metrics = AgentMetrics("rdma-a", "node-1")
    metrics.add_rdma_collector(collector)
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_odd_files_are_skipped_in_what_is_served(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True, counter_value=3)
    hw = n.tree.p("/sys/class/infiniband/rxe0/ports/1/hw_counters")
    (hw / "garbage").write_text("not a number\n")
    (hw / "subdir").mkdir()
    (hw / "rcvd_pkts").unlink()
    (hw / "rcvd_pkts").mkdir()  # unreadable as a file
    m = served(RdmaCounterCollector(n.host, "rdma-a", devices=lambda: [("rxe0", "eth0")]))
    assert m["metaroce_rdma_hw_sent_pkts_total"] == [
        ({"device": "rxe0", "port": "1", "netdev": "eth0", "network": "rdma-a"}, 3.0)
    ]
    assert "metaroce_rdma_hw_garbage_total" not in m and "metaroce_rdma_hw_rcvd_pkts_total" not in m


def test_label_values_are_escaped(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    n.tree.rdma("rxe0", netdev="eth0", software=True, counter_value=3)
    odd = 'e"th\\0\nx'
    m = served(RdmaCounterCollector(n.host, "rdma-a", devices=lambda: [("rxe0", odd)]))
    (labels, value), *_ = m["metaroce_rdma_hw_sent_pkts_total"]
    assert labels["netdev"] == odd and value == 3.0
