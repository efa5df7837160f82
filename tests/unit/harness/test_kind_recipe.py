"""The kind recipe (docs/kind.md, hack/kind/) can only run with Docker: check here what
can be checked without it -- its configs parse and its scripts pass shellcheck."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]


def test_kind_cluster_config_parses() -> None:
    config = yaml.safe_load((REPO / "hack/kind/cluster.yaml").read_text())
    assert config["kind"] == "Cluster"
    assert config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    workers = [n for n in config["nodes"] if n["role"] == "worker"]
    assert len(workers) >= 2
    for w in workers:
        mounts = {m["containerPath"] for m in w["extraMounts"]}
        assert {"/dev/infiniband", "/sys/kernel/config", "/lib/modules"} <= mounts
        assert w["labels"]["metaroce.io/e2e"] == "true"


@pytest.mark.parametrize(
    "script",
    ["hack/kind/up.sh", "hack/build-images.sh", "hack/setup.sh", "hack/show-regressions.sh"],
)
def test_scripts_pass_shellcheck(script: str) -> None:
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.fail(
            "shellcheck is not installed: hack/setup.sh installs it (apt-get install shellcheck)"
        )
    proc = subprocess.run(
        [shellcheck, "-x", str(REPO / script)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stdout


def test_docs_name_the_recipe_files() -> None:
    doc = (REPO / "docs/kind.md").read_text()
    for path in ("hack/kind/up.sh", "hack/kind/cluster.yaml", "tests/e2e/nodes"):
        assert path in doc
