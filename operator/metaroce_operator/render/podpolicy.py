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
  env) says what was injected and is the "already injected" guard (a matchCondition): a
  pod re-created from a mutated one, or a reinvocation, changes nothing.
  `reinvocationPolicy: Never`, as the pod webhook's: the order of several networks'
  policies does not matter (see above), and the reinvocation pass costs the apiserver
  about 0.2 ms of CPU per pod (measured with dry-run creates: 1.6 ms against 1.8 ms).

JSONPatch, not ApplyConfiguration: an apply configuration may not change atomic lists,
and `securityContext.capabilities.add` is one (the apiserver refuses it).

Refusals are the chart's ValidatingAdmissionPolicy (`templates/pod-policies.yaml`): a
badly written annotation, a missing named container, a namespace whose Pod Security level
forbids IPC_LOCK (this policy then injects nothing, so the user reads that reason rather
than PodSecurity's), and a network without a record after mutation, i.e. one that has no
policy: it does not exist (or the operator has not rendered it yet).

The policy and binding are owned by the network (controller owner reference), so the
garbage collector deletes them with it, operator running or not. A `cleanupOnDelete`
network (the only kind the operator holds with its cleanup finalizer) is also the
binding's param: one being deleted while the operator is down stays until the operator is
back, and so would its policy (the garbage collector waits for the owner), but the policy
reads the param's deletionTimestamp and injects nothing, so pods naming it are refused.
Other networks have no param: the apiserver converts a param to CEL for every expression
it evaluates (a JSON round trip of the whole network, measured with
bench/admission_policy_cost.py: about what the rest of the policy costs), on every pod
created, annotated or not, once per network.

Cost (the apiserver runs this for every pod created): each CEL variable is a program of
its own, and each field read walks the typed pod by reflection, so the usual pod (one
container without env, not holding the resource) takes a branch that reads a handful of
fields and emits literal ops, and the general expression keeps its per-container state in
few variables. bench/celcost measures it in the apiserver's own code against the floor of
the same ops as constants (the JSON patch round trip), and checks every change against
another revision: the same pods out for every shared admission case.
"""

from __future__ import annotations

import json
import re
from typing import Any, Final

from metaroce_api import MetaRoceNetwork
from metaroce_api import constants as c
from metaroce_api.podnet import MULTUS_NETWORKS_ANNOTATION, json_entry, nad_name, nad_reference
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


def env_entries(env: dict[str, str]) -> str:
    """CEL: `env` as a container's env list literal, `[{'name': ..., 'value': ...}, ...]`."""
    return "[" + ", ".join(f"{{'name': {lit(k)}, 'value': {lit(v)}}}" for k, v in env.items()) + "]"


def json_text(text: str) -> str:
    """`text` (JSON made of `lit`-safe names and values) as a CEL string literal: JSON's
    quotes and braces need no escape in a single-quoted CEL string, `'` and `\\` would."""
    if "'" in text or "\\" in text:
        raise ValueError(f"{text!r} cannot be rendered into an admission policy (quotes)")
    return f"'{text}'"


def record_env(env: dict[str, str]) -> str:
    """The record's `env` member naming every variable of `env` (JSON text, no brace closing
    the record): what the record says when each target container had no env of its own."""
    for k, v in env.items():
        lit(k), lit(v)  # refuses what would need escaping
    return ',"env":{' + ",".join(f'"{k}":"{v}"' for k, v in env.items()) + "}"


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


ANN: Final = "object.metadata.annotations"
CONTAINERS: Final = "object.spec.containers"


def pod_policy_variables(network: str, resource: str, env: dict[str, str]) -> list[dict[str, str]]:
    """The policy's CEL variables, in evaluation order (each may use the ones before).

    The apiserver evaluates a variable once per admission, when first used, each as a
    program of its own: about 2 us of CPU per variable on top of its expression, and every
    field read walks the typed pod by reflection (profiled: bench/admission_policy_cost.py,
    bench/celcost). So only what is used more than once is a variable, each container field
    is read once into small per-target states, constants are literals where they are used,
    and what a pod does not need (init containers, the annotation's parse for several
    networks) is never evaluated."""
    r = lit(resource)
    has_resource = (
        f"has(c.resources) && ((has(c.resources.requests) && {r} in c.resources.requests) || "
        f"(has(c.resources.limits) && {r} in c.resources.limits))"
    )
    prefix = lit(c.POLICY_INJECTED_PREFIX + "/")
    named = lit(c.CONTAINER_ANNOTATION)
    keys = cel_list(list(env))
    values = cel_map(env)
    return [
        {
            "name": "names",
            "expression": f"{ANN}[{lit(c.NETWORKS_ANNOTATION)}].split(',')"
            ".map(s, s.trim()).filter(s, s != '')",
        },
        {
            # Records of the networks listed after this one whose policies ran already:
            # their values of a variable this network also wants give way to this one's.
            "name": "later",
            "expression": f"variables.names.filter(n, variables.names.indexOf(n) > "
            f"variables.names.indexOf({lit(network)}) && ({prefix} + n) in {ANN})"
            f".map(n, {ANN}[{prefix} + n])",
        },
        {
            "name": "all",
            "expression": f"has(object.spec.initContainers) ? "
            f"{CONTAINERS} + object.spec.initContainers : {CONTAINERS}",
        },
        {
            "name": "holds",
            "expression": f"variables.all.transformList(i, c, {has_resource}, i)",
        },
        {
            # The holders, else the container named by the annotation, else the first.
            "name": "targets",
            "expression": "size(variables.holds) > 0 ? variables.holds : "
            f"!({named} in {ANN}) ? [0] : "
            f"variables.all.exists(c, c.name == {ANN}[{named}]) ? "
            f"[variables.all.transformList(i, c, c.name == {ANN}[{named}], i)[0]] : []",
        },
        {"name": "tcs", "expression": "variables.targets.map(i, variables.all[i])"},
        {
            "name": "paths",
            "expression": f"variables.targets.map(i, i < size({CONTAINERS}) ? "
            f"'/spec/containers/' + string(i) : "
            f"'/spec/initContainers/' + string(i - size({CONTAINERS})))",
        },
        {
            # Per target: how IPC_LOCK gets in. 0: it is there, or the user drops it;
            # 1: no securityContext; 2: no capabilities; 3: no capabilities.add; 4: append.
            "name": "caps",
            "expression": "variables.tcs.map(t, "
            "!has(t.securityContext) ? 1 : !has(t.securityContext.capabilities) ? 2 : "
            "(has(t.securityContext.capabilities.drop) && "
            f"{lit(IPC_LOCK)} in t.securityContext.capabilities.drop) ? 0 : "
            "!has(t.securityContext.capabilities.add) ? 3 : "
            f"{lit(IPC_LOCK)} in t.securityContext.capabilities.add ? 0 : 4)",
        },
        {
            # The default target's resources when no container holds the resource:
            # 0: a container holds it; 1: no resources; 2: resources, no requests;
            # 3: requests only; 4: limits only; 5: both.
            "name": "res",
            "expression": "size(variables.holds) > 0 || size(variables.targets) == 0 ? 0 : "
            "!has(variables.tcs[0].resources) ? 1 : "
            "(has(variables.tcs[0].resources.requests) ? 1 : 0) + "
            "(has(variables.tcs[0].resources.limits) ? 2 : 0) + 2",
        },
        {
            # Per target, the network's variables its env does not set (a target without
            # env, the usual pod, misses them all: no filter to run).
            "name": "missing",
            "expression": f"variables.tcs.map(t, !has(t.env) ? {keys} : "
            f"{keys}.filter(k, !t.env.exists(e, e.name == k)))",
        },
        {
            # Per target: indexes of env entries whose value a later-listed network set.
            "name": "replaced",
            "expression": "variables.tcs.map(t, has(t.env) ? "
            f"t.env.transformList(j, e, e.name in {values} && "
            f"has(e.value) && e.value != {values}[e.name] && "
            "variables.later.exists(r, r.contains('\"' + e.name + '\":')), j) : [])",
        },
    ]


FIRST: Final = "object.spec.containers[0]"


def single_container_expression(resource: str) -> str:
    """CEL: the usual pod, whose only possible target is its one container, which has no
    env and does not hold the resource (no init containers, no `metaroce.io/container`):
    its ops need no per-container state (`single_container_ops`)."""
    r = lit(resource)
    holds = (
        f"(has({FIRST}.resources) && ((has({FIRST}.resources.requests) && "
        f"{r} in {FIRST}.resources.requests) || "
        f"(has({FIRST}.resources.limits) && {r} in {FIRST}.resources.limits)))"
    )
    return (
        f"!has(object.spec.initContainers) && size({CONTAINERS}) == 1 && "
        f"!({lit(c.CONTAINER_ANNOTATION)} in {ANN}) && !has({FIRST}.env) && !{holds}"
    )


def single_container_ops(network: str, resource: str, env: dict[str, str]) -> str:
    """CEL: the ops of the general expression for the pod of `single_container_expression`,
    in the same order, with no variable: the resource into container 0 (by what its
    resources have), IPC_LOCK (by what its securityContext has), all of the network's
    variables as one literal env, and the record (literal but the container's name; it
    names the capability only when one was added)."""
    r = lit(resource)
    esc = f"jsonpatch.escapeKey({r})"
    one = f"{{{r}: '1'}}"
    at = "'/spec/containers/0"
    res = f"{FIRST}.resources"
    both = f"{{'requests': {one}, 'limits': {one}}}"
    whole = f"JSONPatch{{op: 'add', path: {at}/resources', value: {both}}}"
    requests = f"JSONPatch{{op: 'add', path: {at}/resources/requests', value: {one}}}"
    request = f"JSONPatch{{op: 'add', path: {at}/resources/requests/' + {esc}, value: '1'}}"
    limits = f"JSONPatch{{op: 'add', path: {at}/resources/limits', value: {one}}}"
    limit = f"JSONPatch{{op: 'add', path: {at}/resources/limits/' + {esc}, value: '1'}}"
    resource_ops = (
        f"(!has({res}) ? [{whole}] : has({res}.requests) ? "
        f"(has({res}.limits) ? [{request}, {limit}] : [{request}, {limits}]) : "
        f"(has({res}.limits) ? [{requests}, {limit}] : [{requests}, {limits}]))"
    )
    env_op = [f"JSONPatch{{op: 'add', path: {at}/env', value: {env_entries(env)}}}"] if env else []
    lit(resource)  # refuses what would need escaping in the JSON text below
    key = lit(record_key(network))
    rest = f'","resources":{{"{resource}":"1"}}'

    def record(capability: bool) -> str:
        text = rest + (',"capabilities":["IPC_LOCK"]' if capability else "") + record_env(env)
        return (
            "JSONPatch{op: 'add', path: '/metadata/annotations/' + jsonpatch.escapeKey("
            f'{key}), value: \'{{"container":"\' + {FIRST}.name + {json_text(text + "}")}}}'
        )

    with_cap, without = record(True), record(False)

    def then(cap_op: str | None) -> str:
        ops = ([cap_op] if cap_op else []) + env_op + [with_cap if cap_op else without]
        return "[" + ", ".join(ops) + "]"

    ipc = lit(IPC_LOCK)
    sc = f"{FIRST}.securityContext"
    cap_at = f"{at}/securityContext"
    add = f"{{'add': [{ipc}]}}"
    capability_ops = (
        f"(!has({sc}) ? "
        + then(f"JSONPatch{{op: 'add', path: {cap_at}', value: {{'capabilities': {add}}}}}")
        + f" : !has({sc}.capabilities) ? "
        + then(f"JSONPatch{{op: 'add', path: {cap_at}/capabilities', value: {{'add': [{ipc}]}}}}")
        + f" : (has({sc}.capabilities.drop) && {ipc} in {sc}.capabilities.drop) ? "
        + then(None)
        + f" : !has({sc}.capabilities.add) ? "
        + then(f"JSONPatch{{op: 'add', path: {cap_at}/capabilities/add', value: [{ipc}]}}")
        + f" : {ipc} in {sc}.capabilities.add ? "
        + then(None)
        + " : "
        + then(f"JSONPatch{{op: 'add', path: {cap_at}/capabilities/add/-', value: {ipc}}}")
        + ")"
    )
    return f"{resource_ops} + {capability_ops}"


def active_expression() -> str:
    """CEL: the general expression has a target container to inject into."""
    return f"size({CONTAINERS}) > 0 && size(variables.targets) > 0"


def _resource_ops(resource: str) -> str:
    """CEL: ops giving the default target one unit (when no container holds the resource),
    and every holder with a request but no limit the equal limit."""
    r = lit(resource)
    esc = f"jsonpatch.escapeKey({r})"
    one = f"{{{r}: '1'}}"
    at = "variables.paths[0] + '/resources"
    whole = f"JSONPatch{{op: 'add', path: {at}', value: {{'requests': {one}, 'limits': {one}}}}}"
    requests = f"JSONPatch{{op: 'add', path: {at}/requests', value: {one}}}"
    request = f"JSONPatch{{op: 'add', path: {at}/requests/' + {esc}, value: '1'}}"
    limits = f"JSONPatch{{op: 'add', path: {at}/limits', value: {one}}}"
    limit = f"JSONPatch{{op: 'add', path: {at}/limits/' + {esc}, value: '1'}}"
    default = (
        f"variables.res == 0 ? [] : variables.res == 1 ? [{whole}] : "
        f"variables.res == 2 ? [{requests}, {limits}] : variables.res == 3 ? "
        f"[{request}, {limits}] : variables.res == 4 ? [{requests}, {limit}] : [{request}, {limit}]"
    )
    # A holder asking with a request only: the apiserver requires an equal limit.
    req = f"t.resources.requests[{r}]"
    holder_limits = (
        "variables.tcs.transformList(k, t, has(t.resources.requests) && "
        f"{r} in t.resources.requests && "
        f"!(has(t.resources.limits) && {r} in t.resources.limits), "
        "has(t.resources.limits) ? "
        f"JSONPatch{{op: 'add', path: variables.paths[k] + '/resources/limits/' + {esc}, "
        f"value: string({req})}} : "
        "JSONPatch{op: 'add', path: variables.paths[k] + '/resources/limits', "
        f"value: {{{r}: string({req})}}}})"
    )
    return f"({default}) + (size(variables.holds) > 0 ? {holder_limits} : [])"


def _capability_ops() -> str:
    """CEL: per target, IPC_LOCK added unless present or dropped by the user."""
    ipc = lit(IPC_LOCK)
    at = "variables.paths[k] + '/securityContext"
    return (
        "variables.caps.transformList(k, s, s > 0, "
        f"s == 1 ? JSONPatch{{op: 'add', path: {at}', "
        f"value: {{'capabilities': {{'add': [{ipc}]}}}}}} : "
        f"s == 2 ? JSONPatch{{op: 'add', path: {at}/capabilities', value: {{'add': [{ipc}]}}}} : "
        f"s == 3 ? JSONPatch{{op: 'add', path: {at}/capabilities/add', value: [{ipc}]}} : "
        f"JSONPatch{{op: 'add', path: {at}/capabilities/add/-', value: {ipc}}})"
    )


def _env_ops(env: dict[str, str]) -> str:
    """CEL: per target, the missing NCCL variables appended (one op creates `env`: a target
    without env misses all of them, a literal), and the values a later-listed network set
    replaced by this network's."""
    values = cel_map(env)
    add = (
        "variables.tcs.transformList(k, t, size(variables.missing[k]) == 0 ? [] : "
        "!has(t.env) ? [JSONPatch{op: 'add', path: variables.paths[k] + '/env', "
        f"value: {env_entries(env)}}}] : "
        "variables.missing[k].map(v, JSONPatch{op: 'add', path: variables.paths[k] + '/env/-', "
        f"value: {{'name': v, 'value': {values}[v]}}}})).flatten()"
    )
    replace = (
        "variables.tcs.transformList(k, t, variables.replaced[k].map(j, "
        "JSONPatch{op: 'replace', path: variables.paths[k] + '/env/' + string(j) + '/value', "
        f"value: {values}[t.env[j].name]}})).flatten()"
    )
    # The common pod has no variable to replace: skip the second comprehension.
    return f"{add} + (variables.replaced.all(x, size(x) == 0) ? [] : {replace})"


def _record_op(network: str, resource: str, env: dict[str, str]) -> str:
    """CEL: the record annotation, JSON (every value rendered is a safe literal). Its env
    member is a literal when no target had env of its own (all injected, none replaced)."""
    r = lit(resource)
    values = cel_map(env)
    computed = (
        f"',\"env\":{{' + {cel_list(list(env))}.filter(v, "
        "variables.missing.exists(m, v in m) || "
        "variables.tcs.exists(k, t, variables.replaced[k].exists(j, t.env[j].name == v)))"
        f".map(v, '\"' + v + '\":\"' + {values}[v] + '\"').join(',') + '}}}}'"
    )
    parts = [
        "'{\"container\":\"' + variables.tcs[0].name + '\"'",
        f"(variables.res > 0 ? ',\"resources\":{{\"' + {r} + '\":\"1\"}}' : '')",
        "(variables.caps.exists(s, s > 0) ? ',\"capabilities\":[\"IPC_LOCK\"]' : '')",
        f"(variables.tcs.all(t, !has(t.env)) ? {json_text(record_env(env) + '}')} : {computed})",
    ]
    value = " + ".join(parts)
    key = lit(record_key(network))
    return (
        "[JSONPatch{op: 'add', path: '/metadata/annotations/' + jsonpatch.escapeKey("
        f"{key}), value: {value}}}]"
    )


MULTUS: Final = "variables.attachment"
HOST_NETWORK: Final = "(has(object.spec.hostNetwork) && object.spec.hostNetwork)"


def attachment_variable() -> dict[str, str]:
    """The pod's Multus annotation, trimmed ('' when absent)."""
    key = lit(MULTUS_NETWORKS_ANNOTATION)
    return {"name": "attachment", "expression": f"{key} in {ANN} ? {ANN}[{key}].trim() : ''"}


def attachment_ops(namespace: str, network: str, interface: str) -> str:
    """CEL: the op adding the network's Multus attachment to the pod's annotation, as
    `metaroce_api.podnet.merge_networks_annotation` does (the same string surgery)."""
    key = lit(MULTUS_NETWORKS_ANNOTATION)
    nad = nad_name(network)
    ref = nad_reference(namespace, network, interface)
    entry = json_entry(namespace, network, interface)
    path = f"'/metadata/annotations/' + jsonpatch.escapeKey({key})"

    def op(value: str) -> str:
        return f"[JSONPatch{{op: 'add', path: {path}, value: {value}}}]"

    named = json_text(f'"name":"{nad}"')
    in_json = f"{MULTUS}.replace(' ', '').contains({named})"
    in_list = (
        f"{MULTUS}.split(',').exists(p, p.trim().split('@')[0] in "
        f"{cel_list([nad, f'{namespace}/{nad}'])})"
    )
    appended = f"{MULTUS}.substring(0, size({MULTUS}) - 1) + {json_text(',' + entry + ']')}"
    return (
        f"({MULTUS} == '' ? {op(lit(ref))} : {MULTUS}.startsWith('[') ? "
        f"(!{MULTUS}.endsWith(']') || {in_json} ? [] : "
        f"{MULTUS}.substring(1, size({MULTUS}) - 1).trim() == '' ? "
        f"{op(json_text('[' + entry + ']'))} : {op(appended)}) : "
        f"{in_list} ? [] : {op(MULTUS + ' + ' + lit(',' + ref))})"
    )


def pod_patch_expression(network: str, resource: str, env: dict[str, str], forbidden: str) -> str:
    """The JSONPatch mutation (CEL): nothing where the namespace forbids IPC_LOCK; the
    usual pod's ops without per-container state (`single_container_ops`), else the
    general ones when there is a target (`active_expression`); the record last."""
    return f"({forbidden}) ? [] : {pod_mutation(network, resource, env)}"


def pod_mutation(network: str, resource: str, env: dict[str, str]) -> str:
    """`pod_patch_expression` without the Pod Security guard."""
    ops = " + ".join(
        [
            _resource_ops(resource),
            _capability_ops(),
            _env_ops(env),
            _record_op(network, resource, env),
        ]
    )
    return (
        f"({single_container_expression(resource)}) ? "
        f"{single_container_ops(network, resource, env)} : "
        f"({active_expression()}) ? {ops} : []"
    )


def host_variant(text: str) -> str:
    """An expression over the hostNetwork pod's env variables (`missingHost`, ...)."""
    return text.replace("variables.missing", "variables.missingHost").replace(
        "variables.replaced", "variables.replacedHost"
    )


def policy_mutation(
    network: MetaRoceNetwork, settings: RenderSettings, forbidden: str
) -> tuple[list[dict[str, str]], str]:
    """(variables, JSONPatch expression). A network whose pods get a Multus secondary
    interface: a pod on the host network gets the env without the interface variables
    and no attachment (the device plugin's netdev stands), any other pod the attachment
    and the interface (the webhook's `network_env(net, host_network)` and `_attach`)."""
    from metaroce_operator.webhooks.mutate import network_env, pod_attachment

    resource = network.resource_name
    env = network_env(network)
    variables = pod_policy_variables(network.name, resource, env)
    pod_network = pod_attachment(network)
    if pod_network is None:
        return variables, pod_patch_expression(network.name, resource, env, forbidden)
    host_env = network_env(network, host_network=True)
    host_vars = [
        {"name": f"{v['name']}Host", "expression": v["expression"]}
        for v in pod_policy_variables(network.name, resource, host_env)
        if v["name"] in ("missing", "replaced")
    ]
    attach = attachment_ops(settings.namespace, network.name, pod_network.interface)
    host = host_variant(pod_mutation(network.name, resource, host_env))
    other = pod_mutation(network.name, resource, env)
    expression = f"({forbidden}) ? [] : {HOST_NETWORK} ? ({host}) : {attach} + ({other})"
    return [*variables, *host_vars, attachment_variable()], expression


def match_conditions(network: str, *, param: bool = False) -> list[dict[str, str]]:
    """Pods that name this network and carry no record of it yet (the guard), in one
    condition whose cheapest tests come first (CEL's && stops at the first false): it is
    evaluated for every pod created, and again when the apiserver reinvokes policies. The
    name test matches `<network>` between commas with spaces ignored; the chart's
    ValidatingAdmissionPolicy refuses annotations that are not a list of names. Last, with
    `param` (a `cleanupOnDelete` network, the binding's param), the network is not being
    deleted: one that waits on the operator's cleanup finalizer while the operator is down
    keeps its policy (the garbage collector waits for the owner to go), which then injects
    nothing, and the pod is refused as naming no network."""
    ann = "object.metadata.annotations"
    nets = lit(c.NETWORKS_ANNOTATION)
    return [
        {
            "name": "names-this-network-not-injected-yet",
            "expression": f"has({ann}) && {nets} in {ann} && "
            f"!({lit(record_key(network))} in {ann}) && ({ann}[{nets}] == {lit(network)} || "
            f"(',' + {ann}[{nets}].replace(' ', '') + ',').contains({lit(',' + network + ',')}))"
            + (" && !has(params.metadata.deletionTimestamp)" if param else ""),
        }
    ]


def render_pod_policy(network: MetaRoceNetwork, settings: RenderSettings) -> list[dict[str, Any]]:
    """The network's MutatingAdmissionPolicy and its binding (owned by the network)."""
    name = policy_name(network.name)
    labels = {**child_labels(network.name), c.COMPONENT_LABEL: COMPONENT_ADMISSION}
    meta: dict[str, Any] = {"name": name, "labels": labels}
    owners = owner_references(network)
    if owners:
        meta["ownerReferences"] = owners
    forbidden = forbidden_expression(settings.pod_security_check, settings.pod_security_default)
    variables, expression = policy_mutation(network, settings, forbidden)
    # Only a network the operator's cleanup finalizer can hold is the param (module doc).
    param = network.spec.cleanup_on_delete
    policy: dict[str, Any] = {
        "apiVersion": ADMISSION_API,
        "kind": POLICY_KIND,
        "metadata": meta,
        "spec": {
            "failurePolicy": "Fail",
            "reinvocationPolicy": "Never",
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
            "matchConditions": match_conditions(network.name, param=param),
            "variables": variables,
            "mutations": [
                {
                    "patchType": "JSONPatch",
                    "jsonPatch": {"expression": expression},
                }
            ],
        },
    }
    binding: dict[str, Any] = {
        "apiVersion": ADMISSION_API,
        "kind": BINDING_KIND,
        "metadata": json.loads(json.dumps(meta)),
        "spec": {"policyName": name},
    }
    if param:
        # The network itself, for its deletionTimestamp (`match_conditions`).
        policy["spec"]["paramKind"] = {"apiVersion": c.API_VERSION, "kind": c.NETWORK_KIND}
        # Allow: between the network's removal and the garbage collector's of this
        # binding, a missing param skips the policy (Deny would refuse every pod).
        binding["spec"]["paramRef"] = {"name": network.name, "parameterNotFoundAction": "Allow"}
    return [policy, binding]
