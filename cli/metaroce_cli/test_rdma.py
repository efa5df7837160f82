"""`metaroce test-rdma --nodes A,B [--network N]`: does RDMA work between two nodes' pods?

Starts two pods annotated for the network from the images/rdma-test image, one pinned to
each node: the server on B, then the client on A with B's pod IP. They run perftest's
`ib_write_bw` (bandwidth) and `ib_send_lat` (latency) on the device, GID index and
traffic class the admission injected (NCCL_IB_HCA, NCCL_IB_GID_INDEX, NCCL_IB_TC), as a
job's NCCL would use them. Prints both figures, deletes the pods (unless --keep) and
exits 0 only when both moved data: 1 when the test ran and failed, 2 when it could not
start (bad input, no cluster, pods that never ran).

On a `transport.mode: metaroce` network the pods run the `metaroce-perf` the agent
installed and the admission mounted (`/opt/metaroce-transport/bin`), with the injected
`MR_CONFIG` and the pod's own address: the server on B prints its URL, the client on A
runs a bandwidth and a latency round against it.

The plan (`TestPlan`), the pod manifests and the parsing of the tools' output are pure
functions; `main` talks to the cluster through kubectl (logs and pod phases).
"""

from __future__ import annotations

import argparse
import json
import re
import secrets
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from metaroce_api import constants as c
from metaroce_cli.cluster import KubectlMissing, kubectl

DEFAULT_IMAGE_REPOSITORY = "ghcr.io/metaroce/metaroce-rdma-test"
APP_LABEL = "app.kubernetes.io/name"
APP = "metaroce-test-rdma"
RUN_LABEL = "metaroce.io/test-rdma-run"
VERBS_MODES = ("rocev2", "softroce", "auto")
METAROCE_MODE = "metaroce"
MR_BIN = "/opt/metaroce-transport/bin"

# Shell run in both pods: the device, GID and ToS as the admission injected them (NCCL's
# variables), else the first RDMA device and perftest's defaults.
_DEVICE_SCRIPT = r"""
set -u
hca="${NCCL_IB_HCA:-}"; hca="${hca#=}"; hca="${hca#^}"; dev="${hca%%,*}"; dev="${dev%%:*}"
[ -n "$dev" ] || dev="$(ibv_devinfo -l 2>/dev/null | sed -n 2p | tr -d ' \t')"
[ -n "$dev" ] || { echo "no RDMA device in the pod: is the network's resource allocated?"; exit 3; }
flags="-d $dev -F"
[ -n "${NCCL_IB_GID_INDEX:-}" ] && flags="$flags -x $NCCL_IB_GID_INDEX"
[ -n "${NCCL_IB_TC:-}" ] && flags="$flags --tclass=$NCCL_IB_TC"
[ -n "${NCCL_IB_TIMEOUT:-}" ] && flags="$flags -u $NCCL_IB_TIMEOUT"
flags="$flags @EXTRA@"
echo "device $dev, flags $flags"
"""
_SERVER_SCRIPT = (
    _DEVICE_SCRIPT
    + r"""
ib_write_bw $flags -D @SECONDS@ --report_gbits || exit 4
ib_send_lat $flags -n @ITERATIONS@ || exit 5
"""
)
_CLIENT_SCRIPT = (
    _DEVICE_SCRIPT
    + r"""
try() {  # the server listens only once its device is set up: retry the connection
  for i in $(seq 1 @ATTEMPTS@); do
    out="$("$@" "$SERVER_IP" 2>&1)" && { echo "$out"; return 0; }
    case "$out" in
      *"Couldn't connect"*|*"Unable to init"*) sleep 2;;
      *) echo "$out"; return 1;;
    esac
  done
  echo "$out"; return 1
}
echo "== bandwidth"
try ib_write_bw $flags -D @SECONDS@ --report_gbits || exit 4
echo "== latency"
sleep 1
try ib_send_lat $flags -n @ITERATIONS@ || exit 5
echo "== done"
"""
)


# metaroce: the tool the agent installed, the injected MR_CONFIG, the pod's own address.
_MR_CHECK = r"""
set -u
perf=@MR_BIN@/metaroce-perf
[ -x "$perf" ] || { echo "no $perf in the pod: is the network's resource allocated?"; exit 3; }
config="${MR_CONFIG:-},addr=$POD_IP"
echo "metaroce-perf, config $config"
"""
_MR_SERVER_SCRIPT = (
    _MR_CHECK
    + r"""
exec timeout @TIMEOUT@ "$perf" server --sessions 2 --config "$config"
"""
)
_MR_CLIENT_SCRIPT = (
    _MR_CHECK
    + r"""
echo "== bandwidth"
"$perf" client "$SERVER_URL" --mode bw --duration @SECONDS@ --json @EXTRA@ \
  --config "$config" || exit 4
echo "== latency"
"$perf" client "$SERVER_URL" --mode lat --size 8 --iters @ITERATIONS@ --json \
  --config "$config" || exit 5
echo "== done"
"""
)
_LISTENING = re.compile(r"listening on (udp://\S+)")


class PlanError(ValueError):
    """Bad input; the message names the flag, the value and the fix."""


@dataclass(frozen=True)
class TestPlan:
    """What one test-rdma run creates."""

    network: str
    client_node: str
    server_node: str
    namespace: str
    image: str
    run_id: str
    seconds: int = 3
    iterations: int = 1000
    timeout: float = 180.0
    perftest_flags: str = ""
    """More perftest flags for both sides (e.g. `-s 65536 -t 1` on slow emulated nodes)."""
    transport: str = "verbs"
    """`verbs` (perftest on the RDMA device) or `metaroce` (metaroce-perf)."""
    perf_flags: str = ""
    """More metaroce-perf client flags for the bandwidth round (e.g. `--size 65536`)."""

    @property
    def server_name(self) -> str:
        return f"test-rdma-{self.run_id}-server"

    @property
    def client_name(self) -> str:
        return f"test-rdma-{self.run_id}-client"


def make_plan(
    nodes: str,
    network: str | None,
    networks: Sequence[Mapping[str, Any]],
    *,
    namespace: str = "default",
    image: str,
    run_id: str | None = None,
    seconds: int = 3,
    timeout: float = 180.0,
    perftest_flags: str = "",
    perf_flags: str = "",
) -> TestPlan:
    """Check the input against the cluster's networks and name what will be created."""
    names = [n.strip() for n in nodes.split(",") if n.strip()]
    if len(names) != 2 or names[0] == names[1]:
        raise PlanError(
            f"--nodes={nodes!r}: name two different nodes, client first: --nodes node-a,node-b"
        )
    by_name = {str(n["metadata"]["name"]): n for n in networks}
    if network is None:
        if len(by_name) != 1:
            raise PlanError(
                f"--network: {'no network exists' if not by_name else 'several networks exist'}"
                f" ({', '.join(sorted(by_name)) or 'kubectl get mrn'}): name one with --network"
            )
        (network,) = by_name
    if network not in by_name:
        raise PlanError(
            f"--network={network!r}: no such MetaRoceNetwork "
            f"(there are: {', '.join(sorted(by_name)) or 'none'})"
        )
    mode = ((by_name[network].get("spec") or {}).get("transport") or {}).get("mode", "auto")
    if mode not in (*VERBS_MODES, METAROCE_MODE):
        raise PlanError(f"--network={network!r}: transport.mode {mode!r} is not one test-rdma "
                        f"knows ({', '.join((*VERBS_MODES, METAROCE_MODE))})")  # fmt: skip
    transport = "metaroce" if mode == METAROCE_MODE else "verbs"
    if not 1 <= seconds <= 60:
        raise PlanError(f"--seconds={seconds}: give 1-60")
    flag_sets = (
        ("--perftest-flags", perftest_flags, "-s 65536 -t 1"),
        ("--perf-flags", perf_flags, "--size 65536 --window 32"),
    )
    for flag, value, example in flag_sets:
        if not re.fullmatch(r"[-\w =.,]*", value):
            raise PlanError(
                f"{flag}={value!r}: only options (letters, digits, '-', '=', '.', ',' and "
                f"spaces), e.g. '{example}'"
            )
    if transport == "metaroce" and perftest_flags:
        raise PlanError(
            f"--perftest-flags={perftest_flags!r}: network {network} is a metaroce network, "
            "tested with metaroce-perf: give its flags with --perf-flags"
        )
    if transport == "verbs" and perf_flags:
        raise PlanError(
            f"--perf-flags={perf_flags!r}: network {network} moves data with verbs "
            f"(transport.mode {mode}): give perftest flags with --perftest-flags"
        )
    return TestPlan(
        network=network, client_node=names[0], server_node=names[1], namespace=namespace,
        image=image, run_id=run_id or secrets.token_hex(3), seconds=seconds, timeout=timeout,
        perftest_flags=perftest_flags, transport=transport, perf_flags=perf_flags,
    )  # fmt: skip


def pod_manifest(plan: TestPlan, role: str, server: str | None = None) -> dict[str, Any]:
    """The annotated pod of `role` (server or client), pinned to its node by name.
    `server` is the server pod's IP (verbs) or the URL it listens on (metaroce)."""
    node = plan.server_node if role == "server" else plan.client_node
    env: list[dict[str, Any]]
    if plan.transport == "metaroce":
        script = _MR_SERVER_SCRIPT if role == "server" else _MR_CLIENT_SCRIPT
        extra = plan.perf_flags
        env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
        env += [{"name": "SERVER_URL", "value": server}] if server else []
    else:
        script = _SERVER_SCRIPT if role == "server" else _CLIENT_SCRIPT
        extra = plan.perftest_flags
        env = [{"name": "SERVER_IP", "value": server}] if server else []
    attempts = max(5, int(plan.timeout / 4))
    for word, value in (("@SECONDS@", plan.seconds), ("@ITERATIONS@", plan.iterations),
                        ("@ATTEMPTS@", attempts), ("@EXTRA@", extra), ("@MR_BIN@", MR_BIN),
                        ("@TIMEOUT@", int(plan.timeout) + 30)):  # fmt: skip
        script = script.replace(word, str(value))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": plan.server_name if role == "server" else plan.client_name,
            "namespace": plan.namespace,
            "labels": {APP_LABEL: APP, RUN_LABEL: plan.run_id},
            # What a training pod writes: the admission adds the device, IPC_LOCK and NCCL_*.
            "annotations": {c.NETWORKS_ANNOTATION: plan.network},
        },
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            # Ends by itself even if this command is killed before it cleans up.
            "activeDeadlineSeconds": int(plan.timeout) + 60,
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [
                    {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}},
            # The node is chosen by name: its taints (GPU nodes) must not keep the test off.
            "tolerations": [{"operator": "Exists", "effect": "NoSchedule"}],
            "containers": [{
                "name": "rdma", "image": plan.image, "imagePullPolicy": "IfNotPresent",
                "command": ["sh", "-c", script], "env": env,
            }],
        },
    }  # fmt: skip


_ROW = re.compile(r"^\s*\d+\s+\d+\s+[\d.]+")


def _rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines() if _ROW.match(line)]


def parse_bandwidth(text: str) -> float | None:
    """ib_write_bw's average Gb/s (#bytes #iterations BW-peak BW-average MsgRate)."""
    rows = [r for r in _rows(text) if len(r) >= 5]
    return float(rows[-1][3]) if rows else None


def parse_latency(text: str) -> dict[str, float] | None:
    """ib_send_lat's microseconds: min, typical, average, p99 (#bytes #iterations t_min
    t_max t_typical t_avg t_stdev 99% 99.9%)."""
    rows = [r for r in _rows(text) if len(r) >= 8]
    if not rows:
        return None
    r = rows[-1]
    return {"min": float(r[2]), "typical": float(r[4]), "avg": float(r[5]), "p99": float(r[7])}


def client_results(log: str) -> tuple[float | None, dict[str, float] | None]:
    """The bandwidth and latency sections of the client pod's log."""
    _, _, rest = log.partition("== bandwidth")
    bw_text, _, lat_text = rest.partition("== latency")
    return parse_bandwidth(bw_text), parse_latency(lat_text)


def perf_results(log: str) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """The JSON reports of the metaroce client pod's bandwidth and latency rounds."""

    def last_json(text: str) -> dict[str, Any] | None:
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                try:
                    return dict(json.loads(line))
                except ValueError:
                    return None
        return None

    _, _, rest = log.partition("== bandwidth")
    bw_text, _, lat_text = rest.partition("== latency")
    return last_json(bw_text), last_json(lat_text)


def listening_url(log: str) -> str | None:
    """The URL in the metaroce server pod's `listening on udp://...` line."""
    m = _LISTENING.search(log)
    return m.group(1) if m else None


def pending_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a pod cannot run (unschedulable, image, refused), with what to do, or None."""
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("reason") == "Unschedulable":
            msg = str(cond.get("message", ""))
            hint = ""
            if "Insufficient metaroce.io/" in msg or "Insufficient" in msg:
                hint = (" -- the node does not advertise a free unit of the network's resource: "
                        "`metaroce status <network>` says why")  # fmt: skip
            return f"not schedulable: {msg}{hint}"
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
            return (f"{waiting['reason']}: {waiting.get('message', '')} -- build and push "
                    "images/rdma-test and pass --image")  # fmt: skip
        if waiting.get("reason") == "CreateContainerConfigError":
            return f"{waiting['reason']}: {waiting.get('message', '')}"
    return None


def perf_report(
    plan: TestPlan, bw: Mapping[str, Any] | None, lat: Mapping[str, Any] | None
) -> list[str]:
    pair = f"{plan.client_node} -> {plan.server_node}"
    lines = [f"network {plan.network} (metaroce), pods {pair} (namespace {plan.namespace})"]
    if bw and bw.get("messages"):
        lines.append(
            f"  bandwidth (metaroce-perf, {plan.seconds} s): {float(bw['goodput_gbps']):.3f} "
            f"Gb/s, {bw['retransmits']} retransmits ({bw['spurious_retransmits']} spurious) of "
            f"{bw['packets_sent']} packets over {len(bw.get('paths') or [])} paths"
        )
    else:
        lines.append(f"  bandwidth (metaroce-perf, {plan.seconds} s): FAILED")
    if lat and lat.get("messages"):
        p50, p99 = float(lat["lat_p50_us"]), float(lat["lat_p99_us"])
        what = "latency (metaroce-perf, 8 B round trips)"
        lines.append(f"  {what}: p50 {p50:.2f} us, p99 {p99:.2f} us")
    else:
        lines.append("  latency (metaroce-perf, 8 B round trips): FAILED")
    return lines


def report(plan: TestPlan, bw: float | None, lat: Mapping[str, float] | None) -> list[str]:
    pair = f"{plan.client_node} -> {plan.server_node}"
    lines = [f"network {plan.network}, pods {pair} (namespace {plan.namespace})"]
    lines.append(f"  bandwidth (ib_write_bw, {plan.seconds} s): "
                 + (f"{bw:.2f} Gb/s" if bw else "FAILED"))  # fmt: skip
    lines.append("  latency (ib_send_lat): " + (
        f"typical {lat['typical']:.2f} us, avg {lat['avg']:.2f} us, min {lat['min']:.2f} us, "
        f"p99 {lat['p99']:.2f} us" if lat else "FAILED"))  # fmt: skip
    return lines


# --- the cluster side --------------------------------------------------------------------


class Run:
    def __init__(self, plan: TestPlan, kubeconfig: str | None) -> None:
        self.plan = plan
        self.kubeconfig = kubeconfig

    def k(self, *args: str, input: str | None = None, timeout: float = 60) -> Any:
        return kubectl(list(args), self.kubeconfig, input=input, timeout=timeout)

    def pod(self, name: str) -> dict[str, Any] | None:
        got = self.k("get", "pod", name, "-n", self.plan.namespace, "-o", "json")
        return json.loads(got.stdout) if got.returncode == 0 else None

    def create(self, body: Mapping[str, Any]) -> None:
        done = self.k("create", "-f", "-", input=json.dumps(body))
        if done.returncode != 0:  # e.g. refused by the admission: its message says why
            raise RuntimeError(f"cannot create pod {body['metadata']['name']}: "
                               f"{done.stderr.strip()}")  # fmt: skip

    def wait(self, name: str, done: Any, what: str, deadline: float) -> dict[str, Any]:
        while True:
            pod = self.pod(name)
            if pod is not None:
                if done(pod):
                    return pod
                why = pending_reason(pod)
                if why:
                    raise RuntimeError(f"pod {name} {why}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pod {name} not {what} in {self.plan.timeout:.0f} s "
                    f"(`kubectl describe pod -n {self.plan.namespace} {name}`)"
                )
            time.sleep(1)

    def logs(self, name: str) -> str:
        got = self.k("logs", "-n", self.plan.namespace, name, timeout=30)
        return str(got.stdout + got.stderr)

    def cleanup(self) -> None:
        self.k("delete", "pod", "-n", self.plan.namespace, "-l", f"{RUN_LABEL}={self.plan.run_id}",
               "--wait=false", "--ignore-not-found")  # fmt: skip

    def server_url(self, deadline: float) -> str:
        """The metaroce server's URL from its log (its port is chosen from the range)."""
        name = self.plan.server_name
        while True:
            log = self.logs(name)
            url = listening_url(log)
            if url:
                return url
            pod = self.pod(name) or {}
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                raise RuntimeError(f"pod {name} ended before it listened:\n{log.rstrip()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"pod {name} did not listen in {self.plan.timeout:.0f} s:\n"
                                   f"{log.rstrip()}")  # fmt: skip
            time.sleep(1)

    def execute(self) -> int:
        plan = self.plan
        deadline = time.monotonic() + plan.timeout
        self.create(pod_manifest(plan, "server"))
        server = self.wait(
            plan.server_name,
            lambda p: (
                (p.get("status") or {}).get("podIP") and p["status"].get("phase") == "Running"
            ),
            "running",
            deadline,
        )
        print(f"server pod on {plan.server_node} at {server['status']['podIP']}", flush=True)
        target = server["status"]["podIP"]
        if plan.transport == "metaroce":
            target = self.server_url(deadline)
            print(f"metaroce-perf server listening on {target}", flush=True)
        self.create(pod_manifest(plan, "client", target))
        client = self.wait(plan.client_name, lambda p: (p.get("status") or {}).get("phase")
                           in ("Succeeded", "Failed"), "finished", deadline)  # fmt: skip
        log = self.logs(plan.client_name)
        if plan.transport == "metaroce":
            mr_bw, mr_lat = perf_results(log)
            print("\n".join(perf_report(plan, mr_bw, mr_lat)))
            moved = bool(mr_bw and mr_bw.get("messages") and mr_lat and mr_lat.get("messages"))
        else:
            bw, lat = client_results(log)
            print("\n".join(report(plan, bw, lat)))
            moved = bool(bw and lat)
        if client["status"]["phase"] != "Succeeded" or not moved:
            print(f"--- client log ({plan.client_name})\n{log.rstrip()}")
            print(f"--- server log ({plan.server_name})\n{self.logs(plan.server_name).rstrip()}")
            return 1
        return 0


def main(argv: Sequence[str]) -> int:
    from metaroce_operator import __version__

    p = argparse.ArgumentParser(prog="metaroce test-rdma", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", required=True, help="two nodes, client first: A,B")
    p.add_argument("--network", help="the MetaRoceNetwork (default: the only one)")
    p.add_argument(
        "--namespace",
        default="default",
        help="where the pods run; its Pod Security level must allow IPC_LOCK",
    )
    p.add_argument(
        "--image",
        default=f"{DEFAULT_IMAGE_REPOSITORY}:{__version__}",
        help="the images/rdma-test image (perftest); build and push it yourself",
    )
    p.add_argument("--seconds", type=int, default=3, help="bandwidth run length (default 3)")
    p.add_argument("--timeout", type=float, default=180.0, help="for the whole test (s)")
    p.add_argument(
        "--perftest-flags",
        default="",
        help="more ib_write_bw/ib_send_lat flags for both sides, e.g. '-s 65536'",
    )
    p.add_argument(
        "--perf-flags",
        default="",
        help="metaroce networks: more metaroce-perf client flags, e.g. '--size 65536'",
    )
    p.add_argument("--keep", action="store_true", help="leave the pods for a look")
    p.add_argument("--kubeconfig", help="kubeconfig (default: $KUBECONFIG, ~/.kube/config)")
    args = p.parse_args(list(argv))
    try:
        got = kubectl(["get", c.NETWORK_PLURAL, "-o", "json"], args.kubeconfig)
        if got.returncode != 0:
            print(f"metaroce test-rdma: cannot list the networks: {got.stderr.strip()}")
            return 2
        plan = make_plan(args.nodes, args.network, json.loads(got.stdout).get("items") or [],
                         namespace=args.namespace, image=args.image, seconds=args.seconds,
                         timeout=args.timeout, perftest_flags=args.perftest_flags,
                         perf_flags=args.perf_flags)  # fmt: skip
        run = Run(plan, args.kubeconfig)
        try:
            return run.execute()
        except RuntimeError as e:
            print(f"metaroce test-rdma: {e}", file=sys.stderr)
            return 2
        finally:
            if not args.keep:
                run.cleanup()
    except (PlanError, KubectlMissing) as e:
        print(f"metaroce test-rdma: {e}", file=sys.stderr)
        return 2
