"""Generate the CRDs from the models: `python -m metaroce_api.crdgen [--check]`.

pydantic's JSON Schema is not a Kubernetes structural schema, so `structural()` converts
it: `$ref`s inlined, `anyOf [X, null]` collapsed to X (an omitted field is null), `int |
str` turned into `x-kubernetes-int-or-string`, titles dropped. It also refuses what would
make the apiserver reject the CRD or blow CEL's cost budget: a string without `maxLength`,
a list without `maxItems`, a map without `maxProperties`, a keyword it does not know.
"""

import argparse
import difflib
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from metaroce_api import constants as c
from metaroce_api.common import NetworkMeta, ObjectMeta
from metaroce_api.network import MetaRoceNetwork, MetaRoceNetworkSpec, MetaRoceNetworkStatus
from metaroce_api.nodestate import MetaRoceNodeState, MetaRoceNodeStateStatus, NodeStateSpec

Schema = dict[str, Any]

# Keywords a structural schema may carry, as they come out of pydantic (after conversion).
_ALLOWED = {
    "type",
    "description",
    "properties",
    "required",
    "items",
    "additionalProperties",
    "default",
    "enum",
    "format",
    "pattern",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "nullable",
    "x-kubernetes-int-or-string",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
}
_DROPPED = {"title", "$defs", "examples"}
_UNBOUNDED_STRING_FORMATS = {"date-time"}
"""CEL sees these as timestamps, not strings, so their length does not enter the cost."""

HEADER = (
    "# Generated from the metaroce_api models by `python -m metaroce_api.crdgen`. Do not edit.\n"
)


class ConversionError(ValueError):
    """The model cannot be expressed as a structural schema; the message names the field."""


def structural(schema: Mapping[str, Any]) -> Schema:
    """Convert a pydantic JSON Schema (with its `$defs`) into a structural OpenAPI schema."""
    return _convert(schema, schema.get("$defs", {}), "")


def _convert(node: Mapping[str, Any], defs: Mapping[str, Any], path: str) -> Schema:
    where = path or "<root>"
    out: Schema = {k: v for k, v in node.items() if k not in _DROPPED}
    if "$ref" in out:
        name = out.pop("$ref").rsplit("/", 1)[-1]
        if name not in defs:
            raise ConversionError(f"{where}: unresolved $ref {name}")
        return _convert({**defs[name], **out}, defs, path)  # siblings (default, ...) win
    if "allOf" in out:
        parts = out.pop("allOf")
        if len(parts) != 1:
            raise ConversionError(f"{where}: allOf with {len(parts)} parts is not structural")
        return _convert({**parts[0], **out}, defs, path)
    if "anyOf" in out:
        branches = [b for b in out.pop("anyOf") if b.get("type") != "null"]
        if out.get("default", 0) is None:
            del out["default"]
        if len(branches) == 1:
            return _convert({**branches[0], **out}, defs, path)
        if sorted(b.get("type", "") for b in branches) == ["integer", "string"]:
            merged = {k: v for b in branches for k, v in b.items() if k != "type"}
            return _convert({**merged, **out, "x-kubernetes-int-or-string": True}, defs, path)
        raise ConversionError(f"{where}: only `X | None` and `int | str` unions are structural")
    if out.get("default", 0) is None:
        del out["default"]
    if out.get("additionalProperties") is False:
        del out["additionalProperties"]  # unknown fields are pruned or refused anyway
    if "const" in out:
        out["enum"] = [out.pop("const")]
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        # JSON Schema's numeric form (pydantic's gt/lt) is OpenAPI v3.0's bound plus a flag.
        value = out.get(exclusive)
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[bound] = value
            out[exclusive] = True
    unknown = sorted(set(out) - _ALLOWED)
    if unknown:
        raise ConversionError(f"{where}: keyword(s) {unknown} have no structural equivalent")

    if "properties" in out:
        out["properties"] = {
            key: _convert(sub, defs, f"{path}.{key}") for key, sub in out["properties"].items()
        }
    if "items" in out:
        out["items"] = _convert(out["items"], defs, f"{path}[]")
    if isinstance(out.get("additionalProperties"), Mapping):
        out["additionalProperties"] = _convert(out["additionalProperties"], defs, f"{path}{{}}")
    if isinstance(out.get("description"), str):
        # Docstrings wrap at 100 columns; keep paragraphs, unwrap lines.
        out["description"] = re.sub(r"(?<!\n)\n(?!\n)", " ", out["description"].strip())
    _check_bounds(out, where)
    return out


def _check_bounds(node: Schema, where: str) -> None:
    """Every value CEL may walk over has a size bound, and every node a type."""
    typ = node.get("type")
    if node.get("x-kubernetes-int-or-string"):
        typ = "string"
    elif typ is None and not node.get("x-kubernetes-preserve-unknown-fields"):
        raise ConversionError(f"{where}: no type (a structural schema needs one everywhere)")
    if typ == "string" and "maxLength" not in node:
        if "enum" in node:
            node["maxLength"] = max(len(str(v)) for v in node["enum"])
        elif node.get("format") not in _UNBOUNDED_STRING_FORMATS:
            raise ConversionError(f"{where}: string without maxLength (CEL cost is unbounded)")
    if typ == "array":
        if "maxItems" not in node:
            raise ConversionError(f"{where}: list without maxItems (CEL cost is unbounded)")
        if node.get("x-kubernetes-list-type") == "map":
            item = node["items"]
            keys = node.get("x-kubernetes-list-map-keys", [])
            loose = [
                k
                for k in keys
                if k not in item.get("required", []) and "default" not in item["properties"][k]
            ]
            if not keys or loose:
                raise ConversionError(f"{where}: list-type map needs required keys, not {loose}")
    if typ == "object" and "additionalProperties" in node and "maxProperties" not in node:
        raise ConversionError(f"{where}: map without maxProperties (CEL cost is unbounded)")
    if typ == "object" and "additionalProperties" in node and "properties" in node:
        raise ConversionError(f"{where}: properties and additionalProperties are exclusive")


def model_schema(model: type[BaseModel]) -> Schema:
    """Structural schema of a model (validation mode, camelCase names)."""
    return structural(model.model_json_schema(by_alias=True, mode="validation"))


def _doc(model: type[BaseModel]) -> str:
    return (model.__doc__ or "").strip()


def _root_schema(
    root: type[BaseModel],
    meta: type[ObjectMeta],
    spec: type[BaseModel],
    status: type[BaseModel],
) -> Schema:
    meta_schema: Schema = {"type": "object"}
    if meta is not ObjectMeta:  # only name and generateName may be constrained
        name = meta.model_json_schema(by_alias=True)["properties"]["name"]
        meta_schema["properties"] = {"name": structural(name)}
    return {
        "type": "object",
        "description": _doc(root),
        "properties": {
            "apiVersion": {
                "type": "string",
                "description": "APIVersion of this object: metaroce.io/v1alpha1.",
            },
            "kind": {"type": "string", "description": "Kind of this object."},
            "metadata": meta_schema,
            "spec": model_schema(spec),
            "status": model_schema(status),
        },
        "required": ["spec"],
    }


def _column(
    name: str, path: str, typ: str = "string", description: str = "", priority: int = 0
) -> Schema:
    col: Schema = {"name": name, "type": typ, "jsonPath": path}
    if description:
        col["description"] = description
    if priority:
        col["priority"] = priority
    return col


def crd(
    *,
    kind: str,
    list_kind: str,
    plural: str,
    singular: str,
    short_names: Sequence[str],
    schema: Schema,
    columns: Sequence[Schema],
    status_subresource: bool = True,
) -> Schema:
    """A cluster-scoped, single-version CRD; with a status subresource unless told not.

    Without one (`MetaRoceNodeState`: a report written only by its agent, like NFD's
    NodeFeature) `.status` is part of the main resource, so the first report is a single
    create carrying spec and status instead of a create plus a status write.
    """
    version: Schema = {
        "name": c.VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema},
    }
    if status_subresource:
        version["subresources"] = {"status": {}}
    version["additionalPrinterColumns"] = list(columns)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{c.GROUP}",
            "labels": {c.PART_OF_LABEL: c.APP_NAME},
        },
        "spec": {
            "group": c.GROUP,
            "names": {
                "kind": kind,
                "listKind": list_kind,
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": [c.CATEGORY],
            },
            "scope": "Cluster",
            "versions": [version],
        },
    }


def network_crd() -> Schema:
    return crd(
        kind=c.NETWORK_KIND,
        list_kind=c.NETWORK_LIST_KIND,
        plural=c.NETWORK_PLURAL,
        singular=c.NETWORK_SINGULAR,
        short_names=c.NETWORK_SHORT_NAMES,
        schema=_root_schema(
            MetaRoceNetwork, NetworkMeta, MetaRoceNetworkSpec, MetaRoceNetworkStatus
        ),
        columns=[
            _column("Ready", '.status.conditions[?(@.type=="Ready")].status'),
            _column("Nodes", ".status.nodes.summary", description="configured/desired nodes"),
            _column("Transport", ".status.transport.active"),
            _column("Age", ".metadata.creationTimestamp", "date"),
            _column("Mode", ".spec.transport.mode", priority=1),
            _column("Profile", ".spec.qos.profile", priority=1),
            _column("Healthy", ".status.nodes.healthy", "integer", priority=1),
        ],
    )


def nodestate_crd() -> Schema:
    return crd(
        kind=c.NODESTATE_KIND,
        list_kind=c.NODESTATE_LIST_KIND,
        plural=c.NODESTATE_PLURAL,
        singular=c.NODESTATE_SINGULAR,
        short_names=c.NODESTATE_SHORT_NAMES,
        schema=_root_schema(MetaRoceNodeState, ObjectMeta, NodeStateSpec, MetaRoceNodeStateStatus),
        # Written only by its agent: spec and status in one request (see crd()).
        status_subresource=False,
        columns=[
            _column("Network", ".spec.network"),
            _column("Node", ".spec.node"),
            _column("Phase", ".status.phase"),
            _column("Transport", ".status.transport.mode"),
            _column("Generation", ".status.configGeneration", "integer"),
            _column("Age", ".metadata.creationTimestamp", "date"),
        ],
    )


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, so descriptions read like the docstrings."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def to_yaml(obj: Mapping[str, Any]) -> str:
    return HEADER + yaml.dump(dict(obj), Dumper=_Dumper, sort_keys=True, width=4096)


def filename(crd_obj: Mapping[str, Any]) -> str:
    """`<group>_<plural>.yaml`, the usual CRD file name."""
    spec = crd_obj["spec"]
    return f"{spec['group']}_{spec['names']['plural']}.yaml"


def generate() -> dict[str, str]:
    """File name -> YAML text of every CRD."""
    return {filename(obj): to_yaml(obj) for obj in (network_crd(), nodestate_crd())}


CHART_CRD_DIR = Path("charts") / "metaroce" / "files" / "crds"
"""Where the chart keeps its copy: not the chart's `crds/`, which Helm installs on its own
(no values switch, never upgraded); `templates/crds.yaml` renders these files when
`crds.install` is true."""


def default_dirs(root: Path | None = None) -> list[Path]:
    """`crds/` (for `kubectl apply`) and the chart's copy, of the repository."""
    root = root or Path(__file__).resolve().parents[2]
    return [root / "crds", root / CHART_CRD_DIR]


def write(dirs: Iterable[Path] | None = None) -> list[Path]:
    """Write the CRDs into each directory; returns the files that changed."""
    changed = []
    for directory in dirs or default_dirs():
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in generate().items():
            path = directory / name
            if not path.exists() or path.read_text() != text:
                path.write_text(text)
                changed.append(path)
    return changed


def check(dirs: Iterable[Path] | None = None) -> list[str]:
    """Differences between the checked-in CRDs and the models, as unified diffs."""
    problems = []
    for directory in dirs or default_dirs():
        for name, text in generate().items():
            path = directory / name
            current = path.read_text() if path.exists() else ""
            if current != text:
                diff = difflib.unified_diff(
                    current.splitlines(keepends=True),
                    text.splitlines(keepends=True),
                    fromfile=f"{path} (checked in)",
                    tofile=f"{path} (from the models)",
                )
                problems.append("".join(diff) or f"{path}: missing")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m metaroce_api.crdgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    parser.add_argument("--root", type=Path, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    dirs = default_dirs(args.root)
    if args.check:
        problems = check(dirs)
        for problem in problems:
            print(problem, file=sys.stderr)
        if problems:
            print(
                "CRDs are stale: run `python -m metaroce_api.crdgen` and commit the result",
                file=sys.stderr,
            )
            return 1
        print("CRDs are up to date")
        return 0
    for path in write(dirs):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
