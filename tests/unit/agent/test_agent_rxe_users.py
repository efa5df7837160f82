"""Users of an rxe link are seen without hostPID (finding 12): the kernel's `rdma res show`
counts every verbs context on a device whatever the caller's PID namespace (checked on
the guests' 6.1 kernel: a context opened in the host namespace shows as `ctx 1` from a
fresh PID namespace, which sees no such process in /proc), so a revert that finds
contexts other than the agent's own keeps the link.

On b6733c0 (and before this fix) revert looks only in /proc/*/fd: without hostPID it sees
no other process and deletes an rxe link that a job's process holds."""

from __future__ import annotations

from fakes import softroce_node
from test_agent_engine import plan_for, softroce_cfg

from metaroce_agent.engine import Engine, Journal


def test_a_context_hidden_by_a_pid_namespace_keeps_the_link(node) -> None:  # type: ignore[no-untyped-def]
    n = node(softroce_node)
    cfg = softroce_cfg()
    engine = Engine(n.host, Journal(n.host, cfg.network))
    assert engine.apply(plan_for(n, cfg)).ok
    n.tree.write("/sys/class/infiniband/rxe_eth0/fixture_hidden_contexts", "2")
    result = engine.revert()
    assert [name for name, _ in result.errors] == ["rxe-link on rxe_eth0"], result
    assert "2 verbs context(s)" in result.errors[0][1]
    assert n.host.exists("/sys/class/infiniband/rxe_eth0")
    n.tree.write("/sys/class/infiniband/rxe_eth0/fixture_hidden_contexts", "0")
    assert engine.revert().ok  # once they are gone, the retried revert deletes it
    assert not n.host.exists("/sys/class/infiniband/rxe_eth0")
