"""The registry of every CEL rule, found by walking the models the CRDs are made of."""

from pydantic import BaseModel

from metaroce_api.base import ApiModel, Rule
from metaroce_api.network import MetaRoceNetwork
from metaroce_api.nodestate import MetaRoceNodeState


def _models(model: type[BaseModel], seen: dict[type[BaseModel], None]) -> None:
    if model in seen:
        return
    seen[model] = None
    for info in model.model_fields.values():
        for arg in _types_in(info.annotation):
            _models(arg, seen)


def _types_in(annotation: object) -> list[type[BaseModel]]:
    """Model classes inside an annotation such as `list[Toleration] | None`."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    out: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()) or ():
        out += _types_in(arg)
    origin = getattr(annotation, "__origin__", None)
    if origin is not None and not getattr(annotation, "__args__", None):
        out += _types_in(origin)
    return out


def all_rules() -> list[Rule]:
    """Every rule of both kinds, each once, in model order."""
    seen: dict[type[BaseModel], None] = {}
    for root in (MetaRoceNetwork, MetaRoceNodeState):
        _models(root, seen)
    rules: list[Rule] = []
    for model in seen:
        if issubclass(model, ApiModel):
            rules += [r for r in model.cel_rules if r not in rules]
    return rules
