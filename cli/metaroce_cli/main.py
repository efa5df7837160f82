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
    ("crds",): (
        "metaroce_api.crdgen",
        "main",
        "generate (or --check) the CRDs from the API models",
    ),
    ("render",): (
        "metaroce_operator.cli",
        "render_main",
        "print a network's child manifests offline",
    ),
    ("operator",): ("metaroce_operator.cli", "run_main", "run the operator"),
    ("agent",): ("metaroce_agent.cli", "run_main", "run the node agent"),
    ("doctor",): ("metaroce_agent.cli", "doctor_main", "check this node's RDMA setup"),
    ("dev", "cluster"): ("metaroce_harness.cluster", "main", "local control plane (up, build)"),
    ("dev", "guests"): ("metaroce_harness.guests", "main", "SoftRoCE qemu guests (up)"),
}


def _usage() -> str:
    lines = ["usage: metaroce COMMAND [ARGS...]", "", "commands:"]
    for words, (_, _, help_text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<14} {help_text}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    for words, (module, func, _) in sorted(COMMANDS.items(), key=lambda kv: -len(kv[0])):
        if tuple(args[: len(words)]) == words:
            entry = getattr(importlib.import_module(module), func)
            return int(entry(args[len(words) :]) or 0)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    print(f"metaroce: unknown command {' '.join(args[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
