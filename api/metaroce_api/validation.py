"""Validation entry points for the operator, the webhook, the agent and offline rendering.

They apply the same rules as the CRD (the models carry the CEL rules' Python twins) and
turn pydantic's errors into `Issue`s that name the field, the value and the fix.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from metaroce_api.base import RULE_ERROR_TYPE, ApiModel, lookup
from metaroce_api.network import MetaRoceNetwork
from metaroce_api.nodestate import MetaRoceNodeState

M = TypeVar("M", bound=ApiModel)

_UNION_TAGS = {"int", "str", "float", "bool", "list", "dict", "none"}


@dataclass(frozen=True)
class Issue:
    """One problem in an object: where, what was there, and what to do."""

    path: str
    """Dotted path with list indexes, e.g. `spec.tolerations[0].value`."""
    message: str
    value: Any = None
    rule: str | None = None
    """Name of the `Rule` that failed, if it was one."""

    def __str__(self) -> str:
        got = "" if self.value is None else f" (got {self.value!r})"
        return f"{self.path or '<object>'}: {self.message}{got}"


class InvalidObject(ValueError):
    """An object failed validation; `issues` lists every problem."""

    def __init__(self, what: str, issues: list[Issue]) -> None:
        self.what = what
        self.issues = issues
        lines = "\n".join(f"  - {issue}" for issue in issues)
        super().__init__(f"{what} is invalid:\n{lines}")


def join_path(base: str, rel: str) -> str:
    """`spec.qos` + `.pfcPriorities` -> `spec.qos.pfcPriorities`."""
    rel = rel.lstrip(".")
    if not rel:
        return base
    if not base:
        return rel
    return base + ("" if rel.startswith("[") else ".") + rel


def _loc_to_path(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in _UNION_TAGS or part.startswith(("function-", "list[", "dict[")):
            continue  # pydantic's tag for a union member, not a field
        else:
            path = join_path(path, part)
    return path


def issues_from(error: ValidationError) -> list[Issue]:
    """pydantic errors as Issues; a union's per-member errors merge into one."""
    issues: dict[str, Issue] = {}
    for err in error.errors():
        path = _loc_to_path(err["loc"])
        if err["type"] == RULE_ERROR_TYPE:
            for failure in err.get("ctx", {}).get("failures", []):
                full = join_path(path, failure["field"])
                issues[full] = Issue(full, failure["message"], failure["value"], failure["rule"])
            continue
        value = None if err["type"] == "missing" else err.get("input")
        if isinstance(value, Mapping):
            value = None  # a whole object says nothing the path does not
        message = err["msg"]
        if err["type"] == "extra_forbidden":
            message = "unknown field: remove it or check its spelling"
        elif err["type"] == "missing":
            message = "required field is missing: add it"
        if path in issues and issues[path].rule is None and message not in issues[path].message:
            message = f"{issues[path].message}, or {message[0].lower()}{message[1:]}"
        issues[path] = Issue(path, message, value)
    return list(issues.values())


def _update_issues(new: BaseModel, old: BaseModel, path: str) -> list[Issue]:
    """Run the `oldSelf` rules of every sub-object present on both sides, as CEL does."""
    out: list[Issue] = []
    if isinstance(new, ApiModel):
        for rule in type(new).cel_rules:
            if rule.check_update is not None and not rule.check_update(new, old):
                out.append(
                    Issue(
                        join_path(path, rule.field),
                        rule.message,
                        lookup(new, rule.field),
                        rule.name,
                    )
                )
    for name, info in type(new).model_fields.items():
        a, b = getattr(new, name), getattr(old, name, None)
        if isinstance(a, BaseModel) and isinstance(b, type(a)):
            out += _update_issues(a, b, join_path(path, info.alias or name))
    return out


def _describe(obj: Mapping[str, Any] | BaseModel, kind: str) -> str:
    data = obj.to_api() if isinstance(obj, ApiModel) else obj
    meta = data.get("metadata") if isinstance(data, Mapping) else None
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return f"{kind} {name!r}" if name else kind


def _validate(model: type[M], obj: Mapping[str, Any] | M) -> M:
    data = obj.to_api() if isinstance(obj, ApiModel) else obj
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise InvalidObject(_describe(obj, model.__name__), issues_from(err)) from None


def validate_network(obj: Mapping[str, Any] | MetaRoceNetwork) -> MetaRoceNetwork:
    """A MetaRoceNetwork from an API object (dict), checked like the apiserver checks it.

    Raises `InvalidObject` listing every problem with its field path, value and fix.
    """
    return _validate(MetaRoceNetwork, obj)


def validate_network_update(
    old: Mapping[str, Any] | MetaRoceNetwork, new: Mapping[str, Any] | MetaRoceNetwork
) -> MetaRoceNetwork:
    """`validate_network(new)` plus the rules on changes (e.g. resourceName is immutable)."""
    old_net, new_net = validate_network(old), validate_network(new)
    issues = _update_issues(new_net, old_net, "")
    if issues:
        raise InvalidObject(_describe(new_net, "MetaRoceNetwork"), issues)
    return new_net


def validate_nodestate(obj: Mapping[str, Any] | MetaRoceNodeState) -> MetaRoceNodeState:
    """A MetaRoceNodeState from an API object (dict)."""
    return _validate(MetaRoceNodeState, obj)


def validate_nodestate_update(
    old: Mapping[str, Any] | MetaRoceNodeState, new: Mapping[str, Any] | MetaRoceNodeState
) -> MetaRoceNodeState:
    """`validate_nodestate(new)` plus the rules on changes (spec is immutable)."""
    old_ns, new_ns = validate_nodestate(old), validate_nodestate(new)
    issues = _update_issues(new_ns, old_ns, "")
    if issues:
        raise InvalidObject(_describe(new_ns, "MetaRoceNodeState"), issues)
    return new_ns
