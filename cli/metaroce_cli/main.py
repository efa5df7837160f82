"""The `metaroce` command: a thin dispatcher to the packages that do the work.

Each subcommand imports its package only when used, so the agent image (no harness)
and the operator image (no pyverbs) can both ship this entry point.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# subcommand words -> (module, function taking argv, help)
COMMANDS: dict[tuple[str, ...], tuple[str, str, str]] = {
    ("version",): (
        "metaroce_cli.version",
        "main",
        "this CLI's version and, if the cluster answers, the operator's image",
    ),
    ("inject",): (
        "metaroce_cli.inject",
        "main",
        "--dry-run -f pod.yaml: the patch the pod webhook would apply",
    ),
    ("status",): (
        "metaroce_cli.status",
        "main",
        "[NETWORK]: the networks, their nodes, what fails and the fix",
    ),
    ("doctor",): (
        "metaroce_cli.doctor",
        "main",
        "--node N: the agent's doctor in N's agent pods (alone: on this node)",
    ),
    ("test-rdma",): (
        "metaroce_cli.test_rdma",
        "main",
        "--nodes A,B [--network N]: an annotated pod pair moves data",
    ),
    ("operator",): ("metaroce_operator.cli", "run_main", "run the operator"),
    ("agent",): ("metaroce_agent.cli", "run_main", "run the node agent"),
    ("render",): (
        "metaroce_operator.cli",
        "render_main",
        "print a network's child manifests offline",
    ),
    ("crds",): (
        "metaroce_api.crdgen",
        "main",
        "generate (or --check) the CRDs from the API models",
    ),
    ("dev", "cluster"): ("metaroce_harness.cluster", "main", "local control plane (up, build)"),
    ("dev", "guests"): ("metaroce_harness.guests", "main", "SoftRoCE qemu guests (up)"),
}
DEVELOPER_COMMANDS = {("crds",), ("dev", "cluster"), ("dev", "guests")}
"""Listed under their own heading: they need a source checkout, not a cluster."""


def _lines(commands: Sequence[tuple[str, ...]]) -> list[str]:
    return [f"  {' '.join(words):<14} {COMMANDS[words][2]}" for words in commands]


def _usage() -> str:
    user = [w for w in COMMANDS if w not in DEVELOPER_COMMANDS]
    dev = [w for w in COMMANDS if w in DEVELOPER_COMMANDS]
    return "\n".join(
        [
            "usage: metaroce COMMAND [ARGS...]",
            "",
            "commands:",
            *_lines(user),
            "",
            "developer commands (a source checkout):",
            *_lines(dev),
        ]
    )


def _group_usage(prefix: str) -> str:
    """The subcommands of a group word such as `dev`."""
    sub = [w for w in COMMANDS if len(w) > 1 and w[0] == prefix]
    return "\n".join([f"usage: metaroce {prefix} COMMAND [ARGS...]", "", "commands:", *_lines(sub)])


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for words, (module, func, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[: len(words)]) == words:
            entry = getattr(importlib.import_module(module), func)
            return int(entry(args[len(words) :]) or 0)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    groups = {w[0] for w in COMMANDS if len(w) > 1}
    if args[0] in groups:
        if len(args) == 1 or args[1] in ("-h", "--help", "help"):
            print(_group_usage(args[0]))
            return 0
        print(
            f"metaroce: unknown command {' '.join(args[:2])!r}\n\n{_group_usage(args[0])}",
            file=sys.stderr,
        )
        return 2
    print(f"metaroce: unknown command {' '.join(args[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
