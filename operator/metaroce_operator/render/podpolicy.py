"""A network's pod admission inside the apiserver: a MutatingAdmissionPolicy and its binding
(admissionregistration.k8s.io/v1), rendered when the operator runs in `policy` mode.

The policy does for pods annotated `metaroce.io/networks: ...,<network>,...` what the pod
webhook does for that network (`webhooks/mutate.py`), in CEL and JSONPatch, with no call
out of the apiserver, so annotated pods are admitted while the operator is down:
- the container that holds the network's resource (regular or init containers, each of
  them), else the one named by `metaroce.io/container` (may be an init container), else
  the first container, gets `requests`/`limits` of the resource = 1 (only when no
  container asks for it; a request without a limit gets the equal limit);
- each holding container gets `IPC_LOCK` (unless the user drops it) and the network's NCCL
  variables (`mutate.network_env`) that its `env` does not set: user-set values win;
- several networks: each network has its own policy; a variable two networks want goes to
  the one listed first in the annotation, whatever order the apiserver runs the policies
  in (a policy replaces a value that a network listed after it injected, which it knows
  from that network's record; never a value the user set);
- the record `injected.metaroce.io/<network>` (JSON: container, resources, capabilities,
  env) says what was injected and is the "already injected" guard (a matchCondition):
  reinvocation (`reinvocationPolicy: IfNeeded`) changes nothing.

Refusals are the chart's ValidatingAdmissionPolicy (`templates/pod-policies.yaml`): a
badly written annotation, a missing named container, a namespace whose Pod Security level
forbids IPC_LOCK (this policy then injects nothing, so the user reads that reason rather
than PodSecurity's), and a network without a record after mutation, i.e. one that has no
policy: it does not exist (or the operator has not rendered it yet).

The policy and binding are owned by the network (controller owner reference), so the
garbage collector deletes them with it, operator running or not.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from metaroce_api import MetaRoceNetwork
from metaroce_api import constants as c
from metaroce_operator.render.common import child_labels, fit_name, owner_references
from metaroce_operator.settings import RenderSettings
from metaroce_operator.webhooks.mutate import IPC_LOCK, PSS_ENFORCE, PSS_FORBIDS_IPC_LOCK

ADMISSION_API: Final = "admissionregistration.k8s.io/v1"
POLICY_KIND: Final = "MutatingAdmissionPolicy"
BINDING_KIND: Final = "MutatingAdmissionPolicyBinding"
POLICY_PREFIX: Final = "metaroce-pods-"
COMPONENT_ADMISSION: Final = "admission"

_SAFE = re.compile(r"^[A-Za-z0-9._:/,=+@-]*$")
"""What may go into a CEL string literal and a JSON string without escaping (names, numbers,
interface names): anything else is refused at render time rather than mis-quoted."""


def policy_name(network: str) -> str:
    """Name of the network's policy and of its binding: `metaroce-pods-<network>`."""
    return fit_name(POLICY_PREFIX + network)


def lit(text: str) -> str:
    """`text` as a CEL string literal (single-quoted; only characters that need no escape)."""
    if not _SAFE.match(text):
        raise ValueError(
            f"{text!r} cannot be rendered into an admission policy (unusual characters)"
        )
    return f"'{text}'"


def cel_list(items: list[str]) -> str:
    return "[" + ", ".join(lit(i) for i in items) + "]"


def cel_map(items: dict[str, str]) -> str:
    return "{" + ", ".join(f"{lit(k)}: {lit(v)}" for k, v in items.items()) + "}"


def forbidden_expression(check: bool, default_level: str) -> str:
    """CEL: the pod's namespace enforces a Pod Security level that forbids IPC_LOCK
    (its label, else the cluster's default level)."""
    if not check:
        return "false"
    labels = "namespaceObject.metadata.labels"
    level = (
        f"(has({labels}) && {lit(PSS_ENFORCE)} in {labels} ? "
        f"{labels}[{lit(PSS_ENFORCE)}] : {lit(default_level)})"
    )
    return f"{level} in {cel_list(list(PSS_FORBIDS_IPC_LOCK))}"


def record_key(network: str) -> str:
    """The annotation that records what a network's policy injected (and guards it)."""
    return f"{c.POLICY_INJECTED_PREFIX}/{network}"


def pod_policy_variables(
    network: str, resource: str, env: dict[str, str], forbidden: str
) -> list[dict[str, str]]:
    """The policy's CEL variables, in evaluation order (each may use the ones before)."""
    has_resource = (
        f"has(c.resources) && ((has(c.resources.requests) && {lit(resource)} in "
        f"c.resources.requests) || (has(c.resources.limits) && {lit(resource)} in "
        "c.resources.limits))"
    )
    return [
        {"name": "ann", "expression": "object.metadata.annotations"},
        {
            "name": "names",
            "expression": f"variables.ann[{lit(c.NETWORKS_ANNOTATION)}].split(',')"
            ".map(s, s.trim()).filter(s, s != '')",
        },
        {
            # Records of the networks listed after this one whose policies ran already:
            # their values of a variable this network also wants give way to this one's.
            "name": "later",
            "expression": f"variables.names.filter(n, variables.names.indexOf(n) > "
            f"variables.names.indexOf({lit(network)}) && "
            f"({lit(c.POLICY_INJECTED_PREFIX + '/')} + n) in variables.ann)"
            f".map(n, variables.ann[{lit(c.POLICY_INJECTED_PREFIX + '/')} + n])",
        },
        {"name": "forbidden", "expression": forbidden},
        {"name": "n", "expression": "size(object.spec.containers)"},
        {
            "name": "all",
            "expression": "object.spec.containers + (has(object.spec.initContainers) ? "
            "object.spec.initContainers : [])",
        },
        {
            "name": "holds",
            "expression": f"variables.all.transformList(i, c, {has_resource}, i)",
        },
        {
            "name": "named",
            "expression": f"{lit(c.CONTAINER_ANNOTATION)} in variables.ann ? "
            "variables.all.transformList(i, c, c.name == "
            f"variables.ann[{lit(c.CONTAINER_ANNOTATION)}], i) : [0]",
        },
        {
            "name": "targets",
            "expression": "size(variables.holds) > 0 ? variables.holds : "
            "(size(variables.named) > 0 ? [variables.named[0]] : [])",
        },
        {
            "name": "paths",
            "expression": "variables.targets.map(i, i < variables.n ? "
            "'/spec/containers/' + string(i) : '/spec/initContainers/' + string(i - variables.n))",
        },
        {"name": "env", "expression": cel_map(env)},
        {"name": "keys", "expression": cel_list(list(env))},
        {
            "name": "userEnv",
            "expression": "variables.targets.map(i, has(variables.all[i].env) ? "
            "variables.all[i].env.map(e, e.name) : [])",
        },
        {
            "name": "missing",
            "expression": "variables.userEnv.map(u, variables.keys.filter(k, !(k in u)))",
        },
        {
            # Per target: indexes of env entries whose value a later-listed network set.
            "name": "replaced",
            "expression": "variables.targets.map(i, has(variables.all[i].env) ? "
            "variables.all[i].env.transformList(j, e, e.name in variables.env && "
            "has(e.value) && e.value != variables.env[e.name] && "
            "variables.later.exists(r, r.contains('\"' + e.name + '\":')), j) : [])",
        },
        {
            "name": "active",
            "expression": "!variables.forbidden && variables.n > 0 && size(variables.targets) > 0",
        },
    ]


def _resource_ops(resource: str) -> str:
    """CEL: ops giving the default target one unit (when no container holds the resource),
    and every holder with a request but no limit the equal limit."""
    r = lit(resource)
    esc = f"jsonpatch.escapeKey({r})"
    one = f"{{{r}: '1'}}"
    default = (
        "size(variables.holds) > 0 ? [] : "
        "(!has(variables.all[variables.targets[0]].resources) ? "
        "[JSONPatch{op: 'add', path: variables.paths[0] + '/resources', "
        f"value: {{'requests': {one}, 'limits': {one}}}}}] : "
        "(has(variables.all[variables.targets[0]].resources.requests) ? "
        f"[JSONPatch{{op: 'add', path: variables.paths[0] + '/resources/requests/' + {esc}, "
        "value: '1'}] : "
        "[JSONPatch{op: 'add', path: variables.paths[0] + '/resources/requests', "
        f"value: {one}}}]) + "
        "(has(variables.all[variables.targets[0]].resources.limits) ? "
        f"[JSONPatch{{op: 'add', path: variables.paths[0] + '/resources/limits/' + {esc}, "
        "value: '1'}] : "
        "[JSONPatch{op: 'add', path: variables.paths[0] + '/resources/limits', "
        f"value: {one}}}]))"
    )
    # A holder asking with a request only: the apiserver requires an equal limit.
    limits = (
        "variables.targets.transformList(k, i, has(variables.all[i].resources.requests) && "
        f"{r} in variables.all[i].resources.requests && "
        f"!(has(variables.all[i].resources.limits) && {r} in variables.all[i].resources.limits), "
        "has(variables.all[i].resources.limits) ? "
        f"JSONPatch{{op: 'add', path: variables.paths[k] + '/resources/limits/' + {esc}, "
        f"value: string(variables.all[i].resources.requests[{r}])}} : "
        "JSONPatch{op: 'add', path: variables.paths[k] + '/resources/limits', "
        f"value: {{{r}: string(variables.all[i].resources.requests[{r}])}}}})"
    )
    return f"({default}) + (size(variables.holds) > 0 ? {limits} : [])"


def _capability_ops() -> str:
    """CEL: per target, IPC_LOCK added unless present or dropped by the user."""
    ipc = lit(IPC_LOCK)
    sc = "variables.all[i].securityContext"
    return (
        "variables.targets.transformList(k, i, "
        f"has({sc}) && has({sc}.capabilities) && has({sc}.capabilities.drop) && "
        f"{ipc} in {sc}.capabilities.drop ? [] : "
        f"!has({sc}) ? [JSONPatch{{op: 'add', path: variables.paths[k] + '/securityContext', "
        f"value: {{'capabilities': {{'add': [{ipc}]}}}}}}] : "
        f"!has({sc}.capabilities) ? [JSONPatch{{op: 'add', path: variables.paths[k] + "
        f"'/securityContext/capabilities', value: {{'add': [{ipc}]}}}}] : "
        f"!has({sc}.capabilities.add) ? [JSONPatch{{op: 'add', path: variables.paths[k] + "
        f"'/securityContext/capabilities/add', value: [{ipc}]}}] : "
        f"{ipc} in {sc}.capabilities.add ? [] : [JSONPatch{{op: 'add', path: "
        f"variables.paths[k] + '/securityContext/capabilities/add/-', value: {ipc}}}])"
        ".flatten()"
    )


def _env_ops() -> str:
    """CEL: per target, the missing NCCL variables appended (one op creates `env`), and the
    values a later-listed network set replaced by this network's."""
    add = (
        "variables.targets.transformList(k, i, size(variables.missing[k]) == 0 ? [] : "
        "!has(variables.all[i].env) ? [JSONPatch{op: 'add', path: variables.paths[k] + '/env', "
        "value: variables.missing[k].map(v, {'name': v, 'value': variables.env[v]})}] : "
        "variables.missing[k].map(v, JSONPatch{op: 'add', path: variables.paths[k] + '/env/-', "
        "value: {'name': v, 'value': variables.env[v]}})).flatten()"
    )
    replace = (
        "variables.targets.transformList(k, i, variables.replaced[k].map(j, "
        "JSONPatch{op: 'replace', path: variables.paths[k] + '/env/' + string(j) + '/value', "
        "value: variables.env[variables.all[i].env[j].name]})).flatten()"
    )
    return f"{add} + {replace}"


def _record_op(network: str, resource: str) -> str:
    """CEL: the record annotation, JSON (every value rendered is a safe literal)."""
    r = lit(resource)
    parts = [
        "'{\"container\":\"' + variables.all[variables.targets[0]].name + '\"'",
        f"(size(variables.holds) == 0 ? ',\"resources\":{{\"' + {r} + '\":\"1\"}}' : '')",
        "(variables.targets.exists(i, !(has(variables.all[i].securityContext) && "
        "has(variables.all[i].securityContext.capabilities) && "
        "((has(variables.all[i].securityContext.capabilities.add) && 'IPC_LOCK' in "
        "variables.all[i].securityContext.capabilities.add) || "
        "(has(variables.all[i].securityContext.capabilities.drop) && 'IPC_LOCK' in "
        "variables.all[i].securityContext.capabilities.drop)))) ? "
        "',\"capabilities\":[\"IPC_LOCK\"]' : '')",
        "',\"env\":{' + variables.keys.filter(v, variables.missing.exists(m, v in m) || "
        "variables.targets.exists(k, i, variables.replaced[k].exists(j, "
        "variables.all[i].env[j].name == v))).map(v, '\"' + v + '\":\"' + variables.env[v] + "
        "'\"').join(',') + '}}'",
    ]
    value = " + ".join(parts)
    key = lit(record_key(network))
    return (
        "[JSONPatch{op: 'add', path: '/metadata/annotations/' + jsonpatch.escapeKey("
        f"{key}), value: {value}}}]"
    )


def pod_patch_expression(network: str, resource: str) -> str:
    """The JSONPatch mutation (CEL): nothing unless `variables.active`; the record last."""
    ops = " + ".join(
        [_resource_ops(resource), _capability_ops(), _env_ops(), _record_op(network, resource)]
    )
    return f"!variables.active ? [] : {ops}"


def match_conditions(network: str) -> list[dict[str, str]]:
    """Pods that name this network and carry no record of it yet (the guard)."""
    ann = "object.metadata.annotations"
    return [
        {
            "name": "names-this-network",
            "expression": f"has({ann}) && {lit(c.NETWORKS_ANNOTATION)} in {ann} && "
            f"{ann}[{lit(c.NETWORKS_ANNOTATION)}].split(',').exists(s, s.trim() == {lit(network)})",
        },
        {
            "name": "not-injected-yet",
            "expression": f"!({lit(record_key(network))} in {ann})",
        },
    ]


def render_pod_policy(network: MetaRoceNetwork, settings: RenderSettings) -> list[dict[str, Any]]:
    """The network's MutatingAdmissionPolicy and its binding (owned by the network)."""
    from metaroce_operator.webhooks.mutate import network_env

    name = policy_name(network.name)
    resource = network.resource_name
    env = network_env(network)
    labels = {**child_labels(network.name), c.COMPONENT_LABEL: COMPONENT_ADMISSION}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    owners = owner_references(network)
    if owners:
        meta["ownerReferences"] = owners
    forbidden = forbidden_expression(settings.pod_security_check, settings.pod_security_default)
    policy = {
        "apiVersion": ADMISSION_API,
        "kind": POLICY_KIND,
        "metadata": meta,
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "IfNeeded",
            "matchConstraints": {
                "resourceRules": [
                    {
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["pods"],
                    }
                ],
                "namespaceSelector": {
                    "matchExpressions": [
                        {
                            "key": "kubernetes.io/metadata.name",
                            "operator": "NotIn",
                            "values": ["kube-system"],
                        }
                    ]
                },
            },
            "matchConditions": match_conditions(network.name),
            "variables": pod_policy_variables(network.name, resource, env, forbidden),
            "mutations": [
                {
                    "patchType": "JSONPatch",
                    "jsonPatch": {"expression": pod_patch_expression(network.name, resource)},
                }
            ],
        },
    }
    binding = {
        "apiVersion": ADMISSION_API,
        "kind": BINDING_KIND,
        "metadata": json.loads(json.dumps(meta)),
        "spec": {"policyName": name},
    }
    return [policy, binding]
