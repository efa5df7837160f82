"""The README cannot drift: the spec table is generated from the API models, every spec
field appears in it, and the commands it tells users to run are the real ones."""

from __future__ import annotations

import json
from pathlib import Path

from metaroce_harness import chart, specdoc
from metaroce_harness.cluster import LocalCluster

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


def quickstart_commands() -> list[list[str]]:
    """The shell lines of the README's install block, split as the shell would."""
    import shlex

    block = README.split(QUICKSTART_BEGIN, 1)[1].split(QUICKSTART_END, 1)[0]
    lines = [ln for ln in block.splitlines() if ln and not ln.startswith("```")]
    return [shlex.split(ln) for ln in lines]


def test_the_quick_start_install_runs_on_the_real_apiserver(cluster: LocalCluster) -> None:
    """The README's install commands, run as written (kubectl and helm against the local
    control plane; only the operator's pods are kept off kwok's fake nodes), install the
    chart into the user's namespace under the user's release name, CRDs included.

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
        got = cluster.kubectl(
            "get", "deployment", f"{release}-metaroce", "-n", namespace, "-o", "json"
        )  # fmt: skip
        deploy = json.loads(got.stdout)
        image = deploy["spec"]["template"]["spec"]["containers"][0]["image"]
        assert image.startswith("registry.example.com/metaroce-mirror/metaroce/metaroce-operator:")
        assert (
            f"--namespace={namespace}"
            in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
        )
        for crd in ("metarocenetworks.metaroce.io", "metarocenodestates.metaroce.io"):
            got = cluster.kubectl("get", "crd", crd, "-o", "json")
            annotations = json.loads(got.stdout)["metadata"]["annotations"]
            assert annotations["meta.helm.sh/release-name"] == release
            assert annotations["meta.helm.sh/release-namespace"] == namespace
    finally:
        cluster.helm("uninstall", release, "-n", namespace, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def test_the_docs_the_readme_links_are_in_the_repository() -> None:
    for link in ("docs/architecture.md", "docs/contributing.md", "charts/metaroce/README.md"):
        assert f"]({link})" in README and (REPO / link).is_file(), link
    assert "../shared" not in README
