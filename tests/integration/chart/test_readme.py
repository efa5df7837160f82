"""The README cannot drift: the spec table is generated from the API models, every spec
field appears in it, and the commands it tells users to run are the real ones."""

from __future__ import annotations

from pathlib import Path

from metaroce_harness import specdoc

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
