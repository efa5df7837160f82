"""The chart README's table of every value, generated from values.schema.json (keys,
types, meanings) and values.yaml (defaults).

`python -m metaroce_harness.chartdoc` rewrites the table between the markers in
charts/metaroce/README.md; tests/unit/harness/test_chartdoc.py fails when it is out of
date, or when values.yaml and the schema disagree on the keys, so the chart's
documentation cannot drift from what `helm install` checks.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from metaroce_harness.cluster import REPO_ROOT
from metaroce_harness.specdoc import between_markers, rewrite

CHART = REPO_ROOT / "charts" / "metaroce"
README = CHART / "README.md"
BEGIN = "<!-- values-table:begin (generated: python -m metaroce_harness.chartdoc) -->"
END = "<!-- values-table:end -->"
MISSING = object()


def _type(node: Mapping[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"list of {_type(node.get('items') or {})}"
    if kind == "object" and not node.get("properties"):
        extra = node.get("additionalProperties")
        return f"map of {_type(extra)}" if isinstance(extra, dict) else "object"
    return str(kind)


def _default(value: Any) -> str:
    if value is MISSING:
        return ""
    return f"`{json.dumps(value, separators=(',', ':'))}`"


def _cell(text: str) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text.replace("<", "&lt;").replace(">", "&gt;")


def rows(
    schema: Mapping[str, Any], values: Any, path: str = ""
) -> Iterator[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of every key, depth first in the schema's order.

    An object with properties gets a row of its own (its meaning) and its keys below;
    its default is theirs, so it shows none."""
    for name, node in (schema.get("properties") or {}).items():
        key = f"{path}{name}"
        value = values.get(name, MISSING) if isinstance(values, dict) else MISSING
        nested = node.get("type") == "object" and node.get("properties")
        default = "" if nested else _default(value)
        yield key, _type(node), default, _cell(str(node.get("description", "")))
        if nested:
            yield from rows(node, value, key + ".")
        elif node.get("type") == "array" and (node.get("items") or {}).get("properties"):
            yield from rows(node["items"], MISSING, key + "[].")


def value_keys(values: Any, path: str = "") -> Iterator[str]:
    """Every key values.yaml sets, as dotted paths (maps of user data stop at the map)."""
    if not isinstance(values, dict):
        return
    for name, value in values.items():
        yield f"{path}{name}"
        if isinstance(value, dict) and value:
            yield from value_keys(value, f"{path}{name}.")


def load(chart: Path = CHART) -> tuple[dict[str, Any], dict[str, Any]]:
    schema = json.loads((chart / "values.schema.json").read_text())
    values = yaml.safe_load((chart / "values.yaml").read_text())
    return schema, values


def table(chart: Path = CHART) -> str:
    schema, values = load(chart)
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, kind, default, doc in rows(schema, values):
        out.append(f"| `{key}` | {kind} | {default} | {doc} |")
    return "\n".join(out)


def with_table(readme: str, chart: Path = CHART) -> str:
    """`readme` with the generated table between the markers."""
    return between_markers(readme, BEGIN, END, table(chart), str(README))


def main() -> int:
    rewrite(README, with_table(README.read_text()), "values table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
