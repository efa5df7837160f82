"""The README's table of every MetaRoceNetwork spec field, generated from the API models.

`python -m metaroce_harness.specdoc` rewrites the table between the markers in
README.md; tests/integration/chart/test_readme.py fails when it is out of date, so the
documentation cannot drift from the models (metaroce_api.network.MetaRoceNetworkSpec,
the same schema the CRD is generated from).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from metaroce_harness.cluster import REPO_ROOT

README = REPO_ROOT / "README.md"
BEGIN = "<!-- spec-table:begin (generated: python -m metaroce_harness.specdoc) -->"
END = "<!-- spec-table:end -->"


def _type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    kind = str(node.get("type", "any"))
    if kind == "array":
        return f"list of {_type(node.get('items') or {})}"
    if node.get("x-kubernetes-int-or-string"):
        return "int or string"
    if kind == "object" and "additionalProperties" in node:
        return "map"
    return kind


def _default(node: Mapping[str, Any]) -> str:
    if "default" not in node:
        return ""
    value = node["default"]
    if node.get("properties") or (value in ({}, []) and node.get("type") in ("object", "array")):
        return ""  # the fields below carry the defaults
    return f"`{json.dumps(value, separators=(',', ':'))}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def fields(node: Mapping[str, Any], path: str = "spec") -> Iterator[tuple[str, str, str, str]]:
    """(path, type, default, description) of every field, depth first in model order."""
    for name, child in (node.get("properties") or {}).items():
        here = f"{path}.{name}"
        yield here, _type(child), _default(child), _cell(str(child.get("description", "")))
        if child.get("type") == "object":
            yield from fields(child, here)
        elif child.get("type") == "array" and (child.get("items") or {}).get("properties"):
            yield from fields(child["items"], here + "[]")


def spec_schema() -> dict[str, Any]:
    from metaroce_api.crdgen import model_schema
    from metaroce_api.network import MetaRoceNetworkSpec

    return dict(model_schema(MetaRoceNetworkSpec))


def table() -> str:
    rows = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for path, kind, default, doc in fields(spec_schema()):
        rows.append(f"| `{path}` | {kind} | {default} | {doc} |")
    return "\n".join(rows)


def between_markers(text: str, begin: str, end: str, body: str, where: str) -> str:
    """`text` with `body` between the marker lines `begin` and `end` (the generated
    tables' one way in; `where` names the file in the error)."""
    head, sep, rest = text.partition(begin)
    _, sep2, tail = rest.partition(end)
    if not sep or not sep2:
        raise ValueError(f"{where} lacks the markers {begin!r} ... {end!r}")
    return f"{head}{begin}\n{body}\n{end}{tail}"


def rewrite(path: Path, new: str, what: str) -> None:
    """Write `new` to `path` if it differs, saying so."""
    if new != path.read_text():
        path.write_text(new)
        print(f"updated the {what} in {path}")


def with_table(readme: str) -> str:
    """`readme` with the generated table between the markers."""
    return between_markers(readme, BEGIN, END, table(), "README.md")


def main() -> int:
    rewrite(README, with_table(README.read_text()), "spec table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
