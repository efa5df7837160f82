"""A failed re-apply (a pass after the first) restores the last verified state.

The previous configuration is what running jobs use: a pass that fails half-way puts
back the values of the last pass that verified, touches nothing it did not change in
this pass, and never falls back to the pre-agent state of a knob that was verified.
"""

from __future__ import annotations

from conftest import make_config
from fakes import softroce_node

from metaroce_agent.engine import Engine, Journal
from metaroce_agent.plan import make_plan

CM = "/sys/kernel/config/rdma_cm"
TOS = f"{CM}/rxe_eth0/ports/1/default_roce_tos"


def softroce_cfg(**kw):  # type: ignore[no-untyped-def]
    transport = {"mode": "softroce", **kw.pop("transport", {})}
    return make_config(nics={"interfaceNames": ["eth0"]}, transport=transport, **kw)


def plan_for(n, cfg):  # type: ignore[no-untyped-def]
    inv = n.inventory()
    return make_plan(cfg, inv, n.caps(cfg, inv))


def _marked_dscp(n) -> set[int]:  # type: ignore[no-untyped-def]
    table = n.kernel.tc_filters.get(("eth0", "egress"), {})
    vals = set()
    for entry in table.values():
        for action in entry["options"]["actions"]:
            if action["kind"] == "pedit":
                vals.add(int(action["keys"][0]["val"], 16) >> 16 >> 2)
    return vals


def test_failed_dscp_change_keeps_the_verified_config(node) -> None:  # type: ignore[no-untyped-def]
    """The issue's case: DSCP 26 -> 34 with `tc filter replace` failing."""
    n = node(softroce_node)
    cfg = softroce_cfg()
    first = plan_for(n, cfg)
    assert Engine(n.host, Journal(n.host, cfg.network)).apply(first).ok
    assert n.host.read(TOS) == "104" and _marked_dscp(n) == {26}

    n.kernel.fail["tc filter replace"] = (2, "Error: TC classifier not found.")
    n.kernel.calls.clear()
    cfg34 = softroce_cfg(qos={"data": {"dscp": 34}})
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg34))
    assert not result.ok and result.failed_step is not None
    assert result.failed_step.knob == "dscp-mark"
    # the node is as the last verified pass left it: rxe link, marking 26, ToS 104
    assert n.host.exists("/sys/class/infiniband/rxe_eth0"), "the rxe link under the jobs is gone"
    assert _marked_dscp(n) == {26}
    assert "clsact" in n.kernel.qdiscs["eth0"]
    assert n.host.read(TOS) == "104"
    assert not any(c.startswith("rdma link") for c in n.kernel.mutating()), n.kernel.mutating()
    # and the journal still holds every step of it, with the pre-agent originals
    journal = Journal(n.host, cfg.network)
    assert list(journal.entries) == [s.id for s in first.steps]
    engine = Engine(n.host, journal)
    assert all(v is None for v in engine.verify_all(plan_for(n, cfg)).values())
    assert engine.revert().ok
    assert not n.host.exists("/sys/class/infiniband/rxe_eth0")


def test_failed_reapply_restores_changed_values_not_originals(node) -> None:  # type: ignore[no-untyped-def]
    """Steps before the failed one that this pass changed go back to their last verified
    value (MTU 1400), new ones to their original (none here), untouched ones stay."""
    n = node(softroce_node)
    cfg = softroce_cfg(transport={"mtu": 1400})
    assert Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg)).ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1400"

    n.host.unwritable.add(TOS)
    cfg2 = softroce_cfg(transport={"mtu": 1300}, qos={"data": {"dscp": 34}})
    n.kernel.calls.clear()
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg2))
    assert not result.ok and result.failed_step is not None
    assert result.failed_step.knob == "roce-tos"
    assert n.host.read("/sys/class/net/eth0/mtu") == "1400", "not the verified MTU"
    assert _marked_dscp(n) == {26}
    assert n.host.read(TOS) == "104"
    assert n.host.exists("/sys/class/infiniband/rxe_eth0")
    assert not any(c.startswith("rdma link") for c in n.kernel.mutating())
    assert "mtu on eth0" in result.rolled_back and "dscp-mark on eth0" in result.rolled_back

    # once the fault is gone the new config applies, and revert still restores 1500
    n.host.unwritable.discard(TOS)
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg2)).ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1300" and n.host.read(TOS) == "136"
    assert engine.revert().ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1500"


def test_failed_reapply_keeps_steps_the_new_config_drops(node) -> None:  # type: ignore[no-untyped-def]
    """A knob the new config no longer plans stays as verified until the pass succeeds."""
    n = node(softroce_node)
    cfg = softroce_cfg(transport={"mtu": 1400})
    assert Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg)).ok
    n.host.unwritable.add(TOS)
    cfg2 = softroce_cfg(qos={"data": {"dscp": 34}})  # no MTU any more
    result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg2))
    assert not result.ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1400"
    n.host.unwritable.discard(TOS)
    assert Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg2)).ok
    assert n.host.read("/sys/class/net/eth0/mtu") == "1500"  # dropped after success


def test_an_address_family_change_moves_the_marking_filter_to_the_other_protocol(  # type: ignore[no-untyped-def]
    node,
) -> None:
    """roce.addressFamily ipv4 -> ipv6 and back on a marked node: a tc pref holds filters
    of one protocol, so `tc filter replace ... protocol ipv6` at the IPv4 filter's pref is
    refused (seen on the guests: "Filter with specified priority/protocol not found", every
    retry). The step takes its own filter of the other family off first."""
    n = node(softroce_node)
    v4 = softroce_cfg()
    assert Engine(n.host, Journal(n.host, v4.network)).apply(plan_for(n, v4)).ok
    v6 = softroce_cfg(transport={"roce": {"addressFamily": "ipv6"}})
    for cfg, protocol in ((v6, "ipv6"), (v4, "ip")):
        result = Engine(n.host, Journal(n.host, cfg.network)).apply(plan_for(n, cfg))
        assert result.ok, result.error
        table = n.kernel.tc_filters[("eth0", "egress")]
        assert [e["protocol"] for e in table.values()] == [protocol], table
