"""The network's probe key (issue 15 finding 7, the operator side): a Secret per network
with a random key, owned like the other children, mounted into the agents at the path
the agent's probe authentication reads (`probe_auth.DEFAULT_KEY_FILE`).

On b6733c0 (and until this fix) agents got no key and ran the probe side channel
unauthenticated, warning so."""

from __future__ import annotations

import base64
from pathlib import PurePosixPath
from typing import Any

from operator_testlib import network

from metaroce_agent.probe_auth import DEFAULT_KEY_FILE, MIN_KEY_BYTES, PREVIOUS_KEY_FILE
from metaroce_operator.probekey import SECRET_TYPE, new_key, probe_key_secret
from metaroce_operator.render import RenderContext, child_name, render_network
from metaroce_operator.settings import RenderSettings


def _daemonset(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]
    return ds


def test_the_agents_mount_the_network_s_probe_key_where_the_agent_reads_it(
    settings: RenderSettings,
) -> None:
    net = network("net", uid="u-1")
    pod = _daemonset(render_network(net, settings))["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    files: dict[str, str] = {}  # path in the container -> secret key
    for mount in agent["volumeMounts"]:
        for source in volumes[mount["name"]].get("projected", {}).get("sources", []):
            secret = source.get("secret")
            if secret and secret["name"] == child_name("net"):
                assert mount.get("readOnly") is True
                assert "optional" not in secret or secret["optional"] is False
                for item in secret["items"]:
                    files[str(PurePosixPath(mount["mountPath"]) / item["path"])] = item["key"]
    assert files.get(str(DEFAULT_KEY_FILE)) == "key", files
    assert files.get(str(DEFAULT_KEY_FILE.with_name(PREVIOUS_KEY_FILE))) == "previous", files


def test_the_secret_is_owned_like_the_other_children_and_typed(settings: RenderSettings) -> None:
    net = network("net", uid="u-1")
    ctx = RenderContext.build(net, settings)
    secret = probe_key_secret(ctx, new_key())
    ds = _daemonset(render_network(net, settings))
    assert secret["metadata"]["ownerReferences"] == ds["metadata"]["ownerReferences"]
    assert secret["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert secret["type"] == SECRET_TYPE
    key = base64.b64decode(secret["data"]["key"])
    assert len(key) >= 2 * MIN_KEY_BYTES
    assert secret["data"]["previous"] == secret["data"]["key"]
    assert "data" not in probe_key_secret(ctx)  # what the operator patches: metadata only


def test_every_key_is_new() -> None:
    assert len({new_key() for _ in range(100)}) == 100
