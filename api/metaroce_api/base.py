"""The building blocks of the API models: base classes, CEL-backed rules, shared field types.

A `Rule` holds one cross-field rule once: the CEL expression and `fieldPath` that go into
the CRD, the message both sides show, a Python predicate that says the same thing, and one
rejected and one accepted example. Models list their rules in `cel_rules`; the model
validator runs the predicates and the JSON Schema hook publishes the CEL, so the apiserver,
the webhook and offline rendering reject the same objects with the same words.
"""

import ast
import functools
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import PydanticCustomError, core_schema

from metaroce_api.constants import NETWORK_KIND

RULE_ERROR_TYPE = "metaroce_rule"
"""pydantic error type of a failed `Rule`; its ctx carries the field, value and message."""


@dataclass(frozen=True)
class Case:
    """An object both the apiserver and the Python models must judge alike.

    `patch` is deep-merged into the minimal valid object of the rule's kind (see
    `metaroce_api.examples`); a `None` in it deletes the key. For rules that compare with
    the stored object, the object created first is the minimal one merged with `before`,
    and merging `patch` into that makes the update. `field` is where a rejection must point.
    """

    patch: Mapping[str, Any]
    field: str = ""
    before: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Rule:
    """One cross-field rule, in CEL for the CRD and in Python for everything else."""

    name: str
    """Stable id, used by tests and in error contexts."""
    cel: str
    """The CEL expression; `self` is the object of the model that lists the rule."""
    message: str
    """What is wrong and how to fix it; the same text on both sides."""
    check: Callable[[Any], bool] | None = None
    """Python twin of `cel` (True = valid), given the model instance."""
    check_update: Callable[[Any, Any], bool] | None = None
    """Python twin of a rule that uses `oldSelf`, given (new, old) instances."""
    field: str = ""
    """`fieldPath` relative to the model, e.g. `.pfcPriorities`; empty = the model itself."""
    reason: str | None = None
    """CRD `reason` (FieldValueInvalid when unset)."""
    kind: str = NETWORK_KIND
    rejects: Case | None = None
    accepts: Case | None = None

    def __post_init__(self) -> None:
        if (self.check is None) == (self.check_update is None):
            raise ValueError(f"rule {self.name}: give exactly one of check / check_update")
        if self.check_update is not None and "oldSelf" not in self.cel:
            raise ValueError(f"rule {self.name}: an update rule's CEL must use oldSelf")

    @property
    def is_update_rule(self) -> bool:
        return self.check_update is not None

    def to_crd(self) -> dict[str, str]:
        """The `x-kubernetes-validations` entry."""
        out = {"rule": self.cel, "message": self.message}
        if self.field:
            out["fieldPath"] = self.field
        if self.reason:
            out["reason"] = self.reason
        return out


def lookup(model: BaseModel, path: str) -> Any:
    """Value at a camelCase field path such as `.qos.pfcPriorities` (None when absent)."""
    value: Any = model
    for part in filter(None, path.split(".")):
        if not isinstance(value, BaseModel):
            return None
        name = next(
            (n for n, f in type(value).model_fields.items() if (f.alias or n) == part), part
        )
        value = getattr(value, name, None)
    return _plain(value)


def _plain(value: Any) -> Any:
    """Models (also inside lists) as their camelCase JSON form, for messages."""
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class ApiModel(BaseModel):
    """Base of the user-facing (spec) models: camelCase on the wire, unknown fields refused,
    no type coercion (the apiserver refuses `"yes"` for a boolean, so Python does too)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        strict=True,
    )
    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_cel_rules(self) -> Self:
        failures = [
            {"field": r.field, "message": r.message, "rule": r.name, "value": lookup(self, r.field)}
            for r in type(self).cel_rules
            if r.check is not None and not r.check(self)
        ]
        if failures:
            raise PydanticCustomError(
                RULE_ERROR_TYPE,
                "; ".join(f"{f['field'] or '.'}: {f['message']}" for f in failures),
                {"failures": failures},
            )
        return self

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        target = handler.resolve_ref_schema(json_schema)
        _describe_fields(cls, target)
        if cls.cel_rules:
            target["x-kubernetes-validations"] = [r.to_crd() for r in cls.cel_rules]
        return json_schema

    def to_api(self) -> dict[str, Any]:
        """The object as the Kubernetes API wants it: camelCase, JSON types, no nulls."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class StatusModel(ApiModel):
    """Base of what software writes and reads back (status, NodeState, object metadata).

    Unknown fields are ignored, not refused, so an older reader copes with a newer writer;
    timestamps arrive as strings, so types are coerced.
    """

    model_config = ConfigDict(extra="ignore", strict=False)


def attribute_docs(cls: type[BaseModel]) -> dict[str, str]:
    """{field: the docstring under it} for `cls` and its bases: the fields' descriptions.

    Read only when a JSON Schema (the CRDs, the docs) is made. pydantic's own
    `use_attribute_docstrings` parses each class's source while the class is created,
    which was a third of the agent's start-up in the TCG guests (about 5 of 14 s).
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if issubclass(klass, BaseModel) and klass.__module__ in sys.modules:
            docs.update(_module_attribute_docs(klass.__module__).get(klass.__qualname__, {}))
    return docs


@functools.cache
def _module_attribute_docs(module: str) -> dict[str, dict[str, str]]:
    """{class name: {attribute: docstring}} for a module's top-level classes, one parse."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module]))
    except (OSError, TypeError):  # no source (frozen, interactive): no descriptions
        return {}
    found: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        attrs = found.setdefault(node.name, {})
        for prev, cur in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(prev, ast.AnnAssign)
                and isinstance(prev.target, ast.Name)
                and isinstance(cur, ast.Expr)
                and isinstance(cur.value, ast.Constant)
                and isinstance(cur.value.value, str)
            ):
                attrs[prev.target.id] = inspect.cleandoc(cur.value.value)
    return found


def _describe_fields(cls: type[BaseModel], target: JsonSchemaValue) -> None:
    """Give each property without a description its field's docstring."""
    props = target.get("properties")
    if not isinstance(props, dict):
        return
    docs = attribute_docs(cls)
    for name, info in cls.model_fields.items():
        prop = props.get(info.alias if info.alias in props else name)
        if name in docs and isinstance(prop, dict):
            prop.setdefault("description", docs[name])


@dataclass(frozen=True)
class ListType:
    """`x-kubernetes-list-type` for a list field, with the matching uniqueness check.

    `set`: items are unique scalars; `map`: items are objects unique by `keys`;
    `atomic`: replaced as a whole on merge. Used inside `Annotated[list[...], ...]`.
    """

    kind: Literal["atomic", "set", "map"]
    keys: tuple[str, ...] = ()

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        schema = handler(source)
        if self.kind == "atomic":
            return schema
        return core_schema.no_info_after_validator_function(self._unique, schema)

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema["x-kubernetes-list-type"] = self.kind
        if self.keys:
            json_schema["x-kubernetes-list-map-keys"] = list(self.keys)
        return json_schema

    def _unique(self, items: list[Any]) -> list[Any]:
        seen: set[Any] = set()
        for item in items:
            key = (
                tuple(getattr(item, to_snake(k)) for k in self.keys) if self.kind == "map" else item
            )
            if key in seen:
                shown = dict(zip(self.keys, key, strict=True)) if self.kind == "map" else key
                raise PydanticCustomError(
                    "duplicate_item",
                    "duplicate entry {entry}: list each value once",
                    {"entry": repr(shown)},
                )
            seen.add(key)
        return items


def to_snake(camel: str) -> str:
    """`bandwidthPercent` -> `bandwidth_percent` (the inverse of the alias generator)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", camel).lower()


def defaults_to_model(factory: Callable[[], BaseModel]) -> Any:
    """A sub-object field that is always there, with its defaults written out in the CRD.

    Written out in full, not as `{}`: the apiserver checks a default against the CEL rules
    as it stands, without the nested defaults, so `{}` would fail rules that read them.
    """
    default = factory().model_dump(mode="json", by_alias=True, exclude_none=True)
    return Field(default_factory=factory, json_schema_extra={"default": default})


def defaults_to(value: list[Any] | dict[str, Any]) -> Any:
    """A list or map field with a non-empty default, written into the CRD as well."""
    snapshot = list(value) if isinstance(value, list) else dict(value)
    return Field(
        default_factory=lambda: list(snapshot) if isinstance(snapshot, list) else dict(snapshot),
        json_schema_extra={"default": snapshot},
    )


# --- shared field types (string lengths keep CEL within its cost budget) ----------------

DNS_LABEL_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN_RE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_QUALIFIED_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
LABEL_KEY_RE = (
    rf"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?{_QUALIFIED_NAME}$"
)
LABEL_VALUE_RE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
RESOURCE_NAME_RE = (
    rf"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/{_QUALIFIED_NAME}$"
)
QUANTITY_RE = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
DURATION_RE = r"^([0-9]+(ms|s|m|h))+$"
CONDITION_REASON_RE = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"

DnsLabel = Annotated[str, Field(min_length=1, max_length=63, pattern=DNS_LABEL_RE)]
ObjectName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_RE)]
LabelKey = Annotated[str, Field(min_length=1, max_length=317, pattern=LABEL_KEY_RE)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_RE)]
Quantity = Annotated[str, Field(min_length=1, max_length=64, pattern=QUANTITY_RE)]
Duration = Annotated[str, Field(min_length=2, max_length=32, pattern=DURATION_RE)]
"""A Go/CEL duration with whole units: `30s`, `5m`, `1h30m`, `500ms`."""
Dscp = Annotated[int, Field(ge=0, le=63)]
"""A DSCP code point (6 bits)."""
Priority = Annotated[int, Field(ge=0, le=7)]
"""An 802.1p priority (3 bits)."""
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
ShortText = Annotated[str, Field(max_length=1024)]
NodeName = Annotated[str, Field(min_length=1, max_length=253)]

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> timedelta:
    """Parse a `Duration` the way CEL's `duration()` does (whole numbers, ms/s/m/h)."""
    if not re.fullmatch(DURATION_RE, text):
        raise ValueError(f"{text!r} is not a duration: write e.g. 30s, 5m, 1h30m or 500ms")
    seconds = sum(int(n) * _DURATION_UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|s|m|h)", text))
    return timedelta(seconds=seconds)
