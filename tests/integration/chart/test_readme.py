"""The README cannot drift: the spec table is generated from the API models, every spec
field appears in it, and the commands it tells users to run are the real ones."""

from __future__ import annotations

import itertools
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metaroce_api import constants as c
from metaroce_harness import chart, specdoc
from metaroce_harness.cluster import LocalCluster
from metaroce_harness.polling import wait_for

REPO = Path(__file__).resolve().parents[3]
README = (REPO / "README.md").read_text()


def test_spec_table_is_generated_from_the_models() -> None:
    assert specdoc.with_table(README) == README, (
        "README.md spec table out of date: run .venv/bin/python -m metaroce_harness.specdoc"
    )


def test_every_spec_field_and_its_default_is_documented() -> None:
    rows = list(specdoc.fields(specdoc.spec_schema()))
    assert len(rows) > 40
    for path, _kind, default, _doc in rows:
        assert f"| `{path}` |" in README, path
        if default:
            assert f"| `{path}` | " in README and default in README, (path, default)


def test_the_commands_it_names_exist() -> None:
    for command in ("bash hack/demo.sh", "bash .ci/run", "kubectl apply --server-side -f crds/",
                    "helm upgrade metaroce charts/metaroce", "metaroce.io/networks"):  # fmt: skip
        assert command in README, command
    assert (REPO / "hack/demo.sh").is_file() and (REPO / ".ci/run").is_file()
    for sample in ("rocev2-lossless-mellanox", "metaroce-lossy", "softroce-dev"):
        assert f"samples/{sample}.yaml" in README and (REPO / f"samples/{sample}.yaml").is_file()


QUICKSTART_BEGIN = (
    "<!-- quickstart-install (executed by tests/integration/chart/test_readme.py) -->"
)
QUICKSTART_END = "<!-- quickstart-install:end -->"
VERIFY_BEGIN = (
    "<!-- quickstart-verify (executed by tests/integration/chart/test_readme.py, "
    "test-rdma by tests/e2e/nodes) -->"
)
VERIFY_END = "<!-- quickstart-verify:end -->"


def block_commands(begin: str, end: str) -> list[list[str]]:
    """The shell lines of a README block, split as the shell would (continuation lines
    joined, comments dropped)."""
    block = README.split(begin, 1)[1].split(end, 1)[0]
    lines = [ln for ln in block.splitlines() if ln and not ln.startswith("```")]
    return [
        shlex.split(ln, comments=True) for ln in "\n".join(lines).replace("\\\n", " ").split("\n")
    ]


def quickstart_commands() -> list[list[str]]:
    """The shell lines of the README's install block."""
    return block_commands(QUICKSTART_BEGIN, QUICKSTART_END)


def set_values(argv: list[str]) -> dict[str, Any]:
    """The `--set a.b=c` values of a helm command line, nested."""
    values: dict[str, Any] = {}
    for flag, value in itertools.pairwise(argv):
        if flag == "--set":
            path, _, text = value.partition("=")
            *parents, leaf = path.split(".")
            node = values
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = text
    return values


@pytest.fixture(scope="module")
def quickstart(cluster: LocalCluster) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """The README's install commands, run as written (kubectl and helm against the local
    control plane; only the operator's pods are kept off kwok's fake nodes).

    The session's cluster is not fresh: other modules applied the CRDs or installed
    releases that own them, so `--take-ownership` makes them this release's as a fresh
    cluster's install would (tests/integration/chart/test_chart_namespaces.py checks the
    path without it)."""
    commands = quickstart_commands()
    assert [c[0] for c in commands] == ["kubectl", "kubectl", "helm"], commands
    install = commands[-1]
    release, namespace = install[2], install[install.index("-n") + 1]
    assert install[1] == "install" and install[3] == "charts/metaroce"
    try:
        for argv in commands:
            if argv[0] == "kubectl":
                cluster.kubectl(*argv[1:])
            else:
                extra = [*chart.set_flags(chart.HOST_OPERATOR_VALUES), "--take-ownership"]
                args = [str(chart.CHART_DIR) if a == "charts/metaroce" else a for a in argv[1:]]
                cluster.helm(*args, *extra, "--wait=false")
        yield release, namespace, set_values(install)
    finally:
        cluster.kubectl("delete", c.NETWORK_PLURAL, "backend", "--wait=false", check=False)
        cluster.helm("uninstall", release, "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_quick_start_install_runs_on_the_real_apiserver(
    cluster: LocalCluster, quickstart: tuple[str, str, dict[str, Any]]
) -> None:
    """The install step installs the chart into the user's namespace under the user's
    release name, CRDs included."""
    release, namespace, _values = quickstart
    got = cluster.kubectl(
        "get", "deployment", f"{release}-metaroce", "-n", namespace, "-o", "json"
    )  # fmt: skip
    deploy = json.loads(got.stdout)
    image = deploy["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.startswith("registry.example.com/metaroce-mirror/metaroce/metaroce-operator:")
    assert f"--namespace={namespace}" in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    for crd in (c.NETWORK_CRD_NAME, c.NODESTATE_CRD_NAME):
        got = cluster.kubectl("get", "crd", crd, "-o", "json")
        annotations = json.loads(got.stdout)["metadata"]["annotations"]
        assert annotations["meta.helm.sh/release-name"] == release
        assert annotations["meta.helm.sh/release-namespace"] == namespace


def test_the_quick_start_verify_step_runs_on_the_real_apiserver(
    cluster: LocalCluster, quickstart: tuple[str, str, dict[str, Any]], tmp_path: Path
) -> None:
    """Step 3 as written, with the release's real operator (the chart's arguments and
    token, on the host): the sample is admitted by its validating webhook and reconciled,
    `kubectl get mrn`, `metaroce status backend` and the allocatable column run. The
    last line, `metaroce test-rdma`, needs RDMA nodes: tests/e2e/nodes runs it."""
    release, namespace, values = quickstart
    commands = block_commands(VERIFY_BEGIN, VERIFY_END)
    assert [c[:2] for c in commands] == [
        ["kubectl", "apply"], ["kubectl", "get"], ["metaroce", "status"],
        ["kubectl", "get"], ["metaroce", "test-rdma"],
    ], commands  # fmt: skip
    assert '"test-rdma"' in (REPO / "tests/e2e/nodes/test_agents.py").read_text()
    operator = chart.start_host_operator(cluster, release, namespace, tmp_path, values=values)
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    try:
        apply, get_mrn, status, allocatable = commands[:4]
        cluster.kubectl(*(str(REPO / a) if a.startswith("samples/") else a for a in apply[1:]))

        def reconciled() -> bool:
            got = cluster.kubectl("get", c.NETWORK_PLURAL, "backend", "-o", "json").stdout
            return (json.loads(got).get("status") or {}).get("observedGeneration") == 1

        wait_for("the operator's status of the sample", reconciled, timeout=90)
        out = cluster.kubectl(*get_mrn[1:]).stdout
        assert out.split()[:3] == ["NAME", "READY", "NODES"] and "backend" in out, out
        done = subprocess.run(
            [sys.executable, "-m", "metaroce_cli.main", *status[1:]],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        # No node carries the sample's GPU label here: not ready (1), but it answers.
        assert done.returncode in (0, 1) and "backend" in done.stdout, done
        out = cluster.kubectl(*allocatable[1:]).stdout
        assert out.split()[:2] == ["NODE", "UNITS"] and "kwok-a1" in out, out
    finally:
        operator.stop()


def test_the_docs_the_readme_links_are_in_the_repository() -> None:
    for link in ("docs/architecture.md", "docs/contributing.md", "charts/metaroce/README.md"):
        assert f"]({link})" in README and (REPO / link).is_file(), link
    assert "../shared" not in README
