"""One agent process over a persistent fake node (fault_node.py), as the fault tier
starts it: the real `Agent` (engine, journal, planning, reporting) with no apiserver.

    python fault_driver.py ROOT CONFIG OUT {apply|revert} [--attempts N] [--count]

- apply: the agent's start (`apply_pass`), then its retries while the pass fails, up to
  `--attempts` passes in all (the loop's backoff, without the wait);
- revert: what a restarted agent does for a network being deleted with cleanupOnDelete:
  its start-up apply pass, then `revert`, retried while it fails (up to `--attempts`);
- `--count`: count every failpoint (none acts) on top of METAROCE_FAILPOINTS, so the test
  knows how many hits a seed can choose from.

METAROCE_FAILPOINTS chooses where this process is killed or fails. OUT gets the
NodeState status the agent would write, each pass's result and the failpoint hits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from fault_node import NODE_CHANGED, host_for

from metaroce_agent.loop import Agent, AgentOptions
from metaroce_agent.steps import STEP_KINDS
from metaroce_api import failpoints

KILL_POINTS = (
    "apply.before_step",
    "apply.after_step",
    "apply.before_commit",
    "apply.stale.after_undo",
    "restore.after_step",
    "revert.after_step",
    "write_atomic.before_rename",
    NODE_CHANGED,
)
"""Where a seed may kill the agent: one `failpoint(...)` line each in the agent, and the
fake node's after each change it makes (inside a step of several commands)."""
NEVER = 10**9


def _count_everything() -> None:
    """Add a never-reached hit to every failpoint not already set, so all are counted."""
    spec = os.environ.get(failpoints.ENV, "")
    have = set(failpoints.parse(spec))
    names = [*KILL_POINTS]
    names += [f"{op}.step.{k}" for op in ("apply", "restore", "revert") for k in STEP_KINDS]
    extra = [f"{n}={NEVER}" for n in names if n not in have]
    failpoints.reset(",".join(filter(None, [spec, *extra])))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("config", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("phase", choices=["apply", "revert"])
    p.add_argument("--attempts", type=int, default=2)
    p.add_argument("--count", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # the host is built from the files the last (maybe killed) process left
    if args.count:
        _count_everything()
    host = host_for(args.root)
    options = AgentOptions(
        config_path=args.config,
        node_name="node-1",
        report=False,
        metrics_port=None,
        watch=False,
        device_plugin_dir=None,
        pod_resources_socket=None,
    )
    agent = Agent(options, host=host)
    passes: list[dict[str, Any]] = []

    def apply() -> bool:
        result = agent.apply_pass()
        passes.append(
            {
                "pass": "apply",
                "ok": result.ok,
                "failed": result.failed_step.kind if result.failed_step else None,
                "error": result.error,
                "rolled_back": result.rolled_back,
                "undo_errors": result.undo_errors,
                "changed": result.changed,
            }
        )
        return result.ok

    ok = apply()
    for _ in range(args.attempts - 1):
        if ok or args.phase == "revert":
            break
        ok = apply()
    if args.phase == "revert":
        for _ in range(args.attempts):
            agent.revert()
            passes.append({"pass": "revert", "ok": agent.state.reverted})
            if agent.state.reverted:
                break
    status = agent.state.status
    out = {
        "status": None if status is None else status.model_dump(mode="json", by_alias=True),
        "passes": passes,
        "hits": dict(failpoints._hits),
    }
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
