"""Command lines: `metaroce agent --config PATH ...` and `metaroce doctor ...`.

The `metaroce` dispatcher (cli/metaroce_cli) calls `run_main(argv)` and
`doctor_main(argv)`; `python3 -m metaroce_agent {agent,doctor} ...` does the same where
only the agent's packages are on the path (guests, the agent image).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from metaroce_agent.plan import QOS_KNOBS
from metaroce_agent.probe_auth import DEFAULT_KEY_FILE as DEFAULT_PROBE_KEY_FILE
from metaroce_api.constants import AGENT_METRICS_PORT, AGENT_PROBE_PORT, DEVICE_PLUGIN_DIR

log = logging.getLogger("metaroce.agent")

DEFAULT_DEVICE_PLUGIN_DIR = Path(DEVICE_PLUGIN_DIR)
"""Where the kubelet listens for device plugins (k8s.io/kubelet deviceplugin/v1beta1)."""

DEFAULT_METRICS_PORT = AGENT_METRICS_PORT
DEFAULT_PROBE_PORT = AGENT_PROBE_PORT
"""TCP side channel of the RDMA probe (not 18515: perftest uses that one)."""


class UsageError(ValueError):
    pass


def describe_error(exc: BaseException) -> str:
    """`exc` with its type and every cause it was raised from: a start-up error names what
    failed and why (`KeyError: 'server'` alone says neither)."""
    parts: list[str] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        implicit = None if current.__suppress_context__ else current.__context__
        current = current.__cause__ or implicit
    return "; caused by ".join(parts)


def _parse_port(flag: str, text: str, *, allow_zero: bool) -> int:
    low = 0 if allow_zero else 1
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not low <= value <= 65535:
        raise UsageError(
            f"{flag} {text!r}: not a TCP port ({low}-65535): pass e.g. {flag} "
            f"{DEFAULT_METRICS_PORT if 'metrics' in flag else DEFAULT_PROBE_PORT}"
            + (" (0 picks a free port)" if allow_zero else "")
        )
    return value


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)-7s %(name)s: %(message)s",
        stream=sys.stderr,
        force=True,
    )


def _node_name(flag: str | None) -> str:
    return flag or os.environ.get("NODE_NAME") or socket.gethostname()


def _root_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", default="/", help="the node's root: only / (the default)")


def _root(args: argparse.Namespace) -> Path:
    """The root (only /), or UsageError naming the fix."""
    if args.root != "/":
        raise UsageError(
            f"--root {args.root!r}: the agent works on the node itself (/); there is no "
            "fixture mode (fixture trees are for the unit tests, through their FixtureHost)"
        )
    return Path("/")


def agent_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaroce agent",
        description="Run the MetaRoCE node agent for one network on this node.",
    )
    p.add_argument(
        "--config", required=True, help="agent config (the ConfigMap's agent-config.yaml)"
    )
    p.add_argument("--node-name", help="this node's name (default: $NODE_NAME, else the hostname)")
    _root_arguments(p)
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, else in-cluster)")
    p.add_argument("--no-report", action="store_true", help="do not write the NodeState")
    p.add_argument("--metrics-address", default="0.0.0.0")
    p.add_argument("--metrics-port", default=str(DEFAULT_METRICS_PORT), help="0 = a free port")
    p.add_argument("--no-metrics", action="store_true", help="serve no metrics")
    p.add_argument(
        "--state-dir", default="/run/metaroce/agent", help="journal directory (host path)"
    )
    p.add_argument(
        "--skip-knob",
        action="append",
        default=[],
        metavar="KNOB",
        help=f"leave a knob alone, reported as skipped ({', '.join(QOS_KNOBS)})",
    )
    p.add_argument(
        "--require-pyverbs",
        action="store_true",
        help="fail instead of falling back to sysfs when pyverbs is missing",
    )
    p.add_argument("--probe", dest="probe", action="store_true", default=None)
    p.add_argument("--no-probe", dest="probe", action="store_false")
    p.add_argument("--probe-port", default=str(DEFAULT_PROBE_PORT))
    p.add_argument(
        "--probe-key-file",
        default=str(DEFAULT_PROBE_KEY_FILE),
        help="the network's probe key (a mounted Secret) that authenticates probe peers; "
        f"without the file the side channel is not authenticated (default "
        f"{DEFAULT_PROBE_KEY_FILE})",
    )
    p.add_argument(
        "--device-plugin-dir",
        default=str(DEFAULT_DEVICE_PLUGIN_DIR),
        help="the kubelet's device-plugin directory, where the network's device plugin "
        f"registers (default {DEFAULT_DEVICE_PLUGIN_DIR})",
    )
    p.add_argument(
        "--no-device-plugin",
        action="store_true",
        help="do not advertise the network's resource to the kubelet",
    )
    p.add_argument(
        "--once", action="store_true", help="one apply pass, print it, exit (1 = failed)"
    )
    p.add_argument("--revert", action="store_true", help="undo what the agent applied, then exit")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    return p


def run_main(argv: list[str]) -> int:
    """`metaroce agent ...`: exit 0 on a clean stop, 1 on failure, 2 on bad usage."""
    from metaroce_agent.loop import Agent, AgentOptions, ConfigError, load_config

    parser = agent_parser()
    args = parser.parse_args(argv)
    try:
        unknown = sorted(set(args.skip_knob) - set(QOS_KNOBS))
        if unknown:
            raise UsageError(
                f"--skip-knob {unknown[0]!r}: not a knob: use one of {', '.join(QOS_KNOBS)}"
            )
        root = _root(args)
        metrics_port = (
            None
            if args.no_metrics
            else _parse_port("--metrics-port", args.metrics_port, allow_zero=True)
        )
        probe_port = _parse_port("--probe-port", args.probe_port, allow_zero=False)
        plugin_dir = None if args.no_device_plugin else Path(args.device_plugin_dir)
        if plugin_dir is not None and not plugin_dir.is_absolute():
            raise UsageError(
                f"--device-plugin-dir {args.device_plugin_dir!r}: give an absolute path "
                f"(the kubelet's is {DEFAULT_DEVICE_PLUGIN_DIR}), or --no-device-plugin"
            )
        config_path = Path(args.config)
        cfg = load_config(config_path)
    except (UsageError, ConfigError) as e:
        print(f"metaroce agent: {e}", file=sys.stderr)
        return 2
    setup_logging(args.log_level or cfg.log_level)
    options = AgentOptions(
        config_path=config_path,
        node_name=_node_name(args.node_name),
        root=root,
        kubeconfig=args.kubeconfig,
        report=not args.no_report,
        metrics_address=args.metrics_address,
        metrics_port=metrics_port,
        state_dir=args.state_dir,
        skip_knobs=frozenset(args.skip_knob),
        require_pyverbs=args.require_pyverbs,
        probe=args.probe,
        probe_port=probe_port,
        probe_key_file=Path(args.probe_key_file),
        device_plugin_dir=plugin_dir,
    )
    try:
        agent = Agent(options)
    except Exception as e:
        log.error("cannot start the agent: %s", describe_error(e))
        return 1
    if args.revert:
        agent.revert()
        st = agent.state
        print(f"reverted: {st.reverted}; errors: {[e.message for e in st.errors.items] or 'none'}")
        return 0 if st.reverted else 1
    if args.once:
        options.metrics_port = None
        result = agent.apply_pass()
        status = agent.state.status
        assert status is not None
        message = status.conditions[0].message if status.conditions else ""
        print(f"phase {status.phase}: {message}")
        steps, took = len(result.applied), result.seconds
        print(f"apply: {steps} step(s), {result.changed} changed, {took:.3f} s")
        print("timings " + json.dumps({k: round(v, 4) for k, v in agent.state.timings.items()}))
        return 0 if result.ok else 1
    _install_stop(agent)
    _maybe_probe(agent, options)
    return agent.run()


def _maybe_probe(agent: object, options: object) -> None:
    """Attach the prober when enabled: RDMA (it needs pyverbs), or UDP for metaroce."""
    from metaroce_agent.loop import Agent, AgentOptions

    assert isinstance(agent, Agent) and isinstance(options, AgentOptions)
    enabled = agent.config.probe.enabled if options.probe is None else options.probe
    if not enabled or agent.kube is None:
        return
    try:
        from metaroce_agent.probe import Prober
    except ImportError as e:  # pragma: no cover - probe module missing
        log.warning("RDMA probe unavailable: %s", e)
        return
    agent.prober = Prober.for_agent(agent)


def _install_stop(agent: object) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        log.info("signal %d: stopping (node settings stay)", signum)
        agent.stop()  # type: ignore[attr-defined]

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def doctor_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="metaroce doctor",
        description="Check this node's RDMA setup: devices, GIDs, QoS, problems and fixes. "
        "Exits 1 when the node is not ready.",
    )
    p.add_argument("--config", help="an agent config: also check the network's knobs")
    _root_arguments(p)
    p.add_argument("--node-name")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--require-pyverbs", action="store_true")
    p.add_argument("-v", "--verbose", action="store_true", help="log what is run")
    return p


def doctor_main(argv: list[str]) -> int:
    from metaroce_agent.doctor import examine, render, to_json
    from metaroce_agent.host import Host
    from metaroce_agent.loop import ConfigError, load_config

    args = doctor_parser().parse_args(argv)
    setup_logging("debug" if args.verbose else "error")
    try:
        root = _root(args)
        cfg = load_config(Path(args.config)) if args.config else None
    except (UsageError, ConfigError) as e:
        print(f"metaroce doctor: {e}", file=sys.stderr)
        return 2
    ex = examine(
        Host(root),
        cfg,
        _node_name(args.node_name),
        require_pyverbs=args.require_pyverbs,
    )
    print(to_json(ex) if args.json else render(ex))
    return 0 if ex.ready else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "doctor":
        return doctor_main(args[1:])
    if args and args[0] in ("agent", "run"):
        return run_main(args[1:])
    print("usage: python3 -m metaroce_agent {agent|doctor} [ARGS...]", file=sys.stderr)
    return 2
