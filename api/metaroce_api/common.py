"""Kubernetes shapes the MetaRoCE kinds reuse: label selector, toleration, condition, metadata.

They mirror the core types field for field so the operator can pass them through to the
DaemonSet unchanged, with size limits added (a CRD needs them for CEL cost estimates).
"""

from datetime import datetime
from typing import Annotated, Literal

from pydantic import Field

from metaroce_api.base import (
    CONDITION_REASON_RE,
    ApiModel,
    Case,
    DnsLabel,
    LabelKey,
    LabelValue,
    ListType,
    Rule,
    StatusModel,
)


class LabelSelectorRequirement(ApiModel):
    """One `matchExpressions` term (metav1.LabelSelectorRequirement)."""

    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: Annotated[list[LabelValue], Field(max_length=64), ListType("atomic")] | None = None
    """Required for In and NotIn; must be empty for Exists and DoesNotExist."""

    cel_rules = (
        Rule(
            name="selector-values-match-operator",
            cel=(
                "self.operator in ['In', 'NotIn'] ? "
                "(has(self.values) && size(self.values) > 0) : "
                "(!has(self.values) || size(self.values) == 0)"
            ),
            field=".values",
            message=(
                "operators In and NotIn need at least one value, Exists and DoesNotExist "
                "take none: fix values or the operator"
            ),
            check=lambda s: bool(s.values) == (s.operator in ("In", "NotIn")),
            rejects=Case(
                {"spec": {"nodeSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}},
                field="spec.nodeSelector.matchExpressions[0].values",
            ),
            accepts=Case(
                {
                    "spec": {
                        "nodeSelector": {
                            "matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]
                        }
                    }
                }
            ),
        ),
    )


class LabelSelector(ApiModel):
    """A label selector (metav1.LabelSelector); empty selects every node."""

    match_labels: Annotated[dict[str, LabelValue], Field(max_length=64)] | None = None
    match_expressions: (
        Annotated[list[LabelSelectorRequirement], Field(max_length=32), ListType("atomic")] | None
    ) = None


class Toleration(ApiModel):
    """A toleration for the agent pods (core/v1 Toleration)."""

    key: Annotated[str, Field(max_length=317)] | None = None
    """Taint key; empty with operator Exists tolerates every taint."""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: LabelValue | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Empty matches every effect."""
    toleration_seconds: int | None = None
    """How long a NoExecute taint is tolerated before eviction; unset = forever."""

    cel_rules = (
        Rule(
            name="toleration-exists-has-no-value",
            cel="self.operator != 'Exists' || !has(self.value) || size(self.value) == 0",
            field=".value",
            message="operator Exists matches any value: remove value, or use operator Equal",
            check=lambda s: s.operator != "Exists" or not s.value,
            rejects=Case(
                {"spec": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}},
                field="spec.tolerations[0].value",
            ),
            accepts=Case({"spec": {"tolerations": [{"key": "k", "operator": "Exists"}]}}),
        ),
        Rule(
            name="toleration-empty-key-needs-exists",
            cel="(has(self.key) && size(self.key) > 0) || self.operator == 'Exists'",
            field=".operator",
            message=(
                "a toleration without key tolerates every taint and needs operator Exists: "
                "set key, or set operator: Exists"
            ),
            check=lambda s: bool(s.key) or s.operator == "Exists",
            rejects=Case(
                {"spec": {"tolerations": [{"operator": "Equal", "value": "v"}]}},
                field="spec.tolerations[0].operator",
            ),
            accepts=Case({"spec": {"tolerations": [{"operator": "Exists"}]}}),
        ),
        Rule(
            name="toleration-seconds-needs-noexecute",
            cel="!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            field=".tolerationSeconds",
            message=(
                "tolerationSeconds applies only to effect NoExecute: set that effect or drop it"
            ),
            check=lambda s: s.toleration_seconds is None or s.effect == "NoExecute",
            rejects=Case(
                {
                    "spec": {
                        "tolerations": [
                            {"key": "k", "effect": "NoSchedule", "tolerationSeconds": 30}
                        ]
                    }
                },
                field="spec.tolerations[0].tolerationSeconds",
            ),
            accepts=Case(
                {
                    "spec": {
                        "tolerations": [
                            {"key": "k", "effect": "NoExecute", "tolerationSeconds": 30}
                        ]
                    }
                }
            ),
        ),
    )


class Condition(StatusModel):
    """A status condition (metav1.Condition)."""

    type: Annotated[str, Field(min_length=1, max_length=316)]
    """Ready, Progressing or Degraded (see `constants.CONDITION_TYPES`)."""
    status: Literal["True", "False", "Unknown"]
    observed_generation: Annotated[int, Field(ge=0)] | None = None
    """The `.metadata.generation` the condition was computed from."""
    last_transition_time: datetime
    """When `status` last changed."""
    reason: Annotated[str, Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_RE)]
    """CamelCase reason (see the `REASON_*` constants)."""
    message: Annotated[str, Field(max_length=32768)] = ""
    """Human-readable detail: what is wrong and what to do."""


Conditions = Annotated[list[Condition], Field(max_length=8), ListType("map", ("type",))]


class ObjectMeta(StatusModel):
    """The part of metav1.ObjectMeta the MetaRoCE code reads; the rest is ignored."""

    name: Annotated[str, Field(min_length=1, max_length=253)]
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: datetime | None = None
    deletion_timestamp: datetime | None = None
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None
    finalizers: list[str] | None = None


class NetworkMeta(ObjectMeta):
    """Metadata of a network: its name ends up in label values and resource names (<= 63)."""

    name: DnsLabel
