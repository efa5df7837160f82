"""The docs name real files: every repository path a reader is pointed at exists (issue 17:
the architecture page is kept in step with the code). A moved or renamed file fails here
instead of leaving a dead pointer in README.md, the chart's README or docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCS = ["README.md", "charts/metaroce/README.md", *sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md")
)]  # fmt: skip
TOP = ("api", "bench", "charts", "cli", "crds", "docs", "hack", "images", "node-agent",
       "operator", "samples", "tests", "transport")  # fmt: skip
PATH = re.compile(r"`((?:" + "|".join(TOP) + r")/[A-Za-z0-9_./-]*)`")
NOT_IN_GIT = ("transport/target", "transport/fuzz/artifacts")
"""Build outputs the docs name on purpose (made by the build, ignored by git)."""


def named_paths(text: str) -> list[str]:
    return [m for m in PATH.findall(text) if not m.startswith(NOT_IN_GIT)]


@pytest.mark.parametrize("doc", DOCS)
def test_every_repository_path_in_the_docs_exists(doc: str) -> None:
    missing = [p for p in named_paths((REPO / doc).read_text()) if not (REPO / p).exists()]
    assert not missing, f"{doc} names paths that are not in the repository: {missing}"


def test_named_paths() -> None:
    text = "see `charts/metaroce/files/crds/` and `render/` and `transport/target/x.so`"
    assert named_paths(text) == ["charts/metaroce/files/crds/"]
