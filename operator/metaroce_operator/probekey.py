"""The network's probe key: a Secret per network, made once by the operator, mounted
into its agents at `/etc/metaroce/probe/key` (node-agent `probe_auth`).

Unlike the other children the Secret is not rendered and applied each reconcile: its key
is random, so it is created once (with a fresh key) and afterwards only its metadata
(owner references, labels) is kept right; its data is never rewritten, so a rotation
made by hand is kept. The key is never logged: nothing here logs a body.

Rotation, by whoever may write the Secret (a kubectl patch or a secret manager): put the
new key in `key` and the old one in `previous`, wait until every node has the update
(the kubelet refreshes a mounted Secret within about a minute plus its sync period), then
put the new key in `previous` too. The agents accept both keys and agree on one they
share, so the nodes never see each other as unreachable during a rotation.
"""

from __future__ import annotations

import base64
import logging
import secrets
from typing import Any

from metaroce_operator.kube import KINDS, ApiError, Kube
from metaroce_operator.render.common import RenderContext

log = logging.getLogger(__name__)

SECRET = KINDS[("v1", "Secret")]
SECRET_TYPE = "metaroce.io/probe-key"
"""The Secret's type: the operator's admission policy lets it write Secrets of this type
(and its webhook certificate) only."""
KEY = "key"
PREVIOUS = "previous"
KEY_BYTES = 32


def new_key() -> str:
    """A fresh key: 32 random bytes, hex (the agent strips whitespace, wants >= 16 bytes)."""
    return secrets.token_hex(KEY_BYTES)


def probe_key_secret(ctx: RenderContext, key: str | None = None) -> dict[str, Any]:
    """The network's probe-key Secret; with `key`, its data (`key` and `previous` both
    that key: the mount lists both files, so both must exist)."""
    secret: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": ctx.name,
            "namespace": ctx.namespace,
            "labels": ctx.labels,
            "ownerReferences": ctx.owner_refs,
        },
        "type": SECRET_TYPE,
    }
    if key is not None:
        encoded = base64.b64encode(key.encode()).decode()
        secret["data"] = {KEY: encoded, PREVIOUS: encoded}
    return secret


async def ensure_probe_key(kube: Kube, ctx: RenderContext) -> bool:
    """Create the network's probe-key Secret with a fresh key, or, when it exists, set
    only its labels and owner references. True when it was created."""
    try:
        await kube.create(probe_key_secret(ctx, new_key()))
    except ApiError as err:
        if err.status != 409:
            raise
    else:
        log.info("created the probe key Secret %s/%s of %s", ctx.namespace, ctx.name,
                 ctx.network.name)  # fmt: skip
        return True
    meta = probe_key_secret(ctx)["metadata"]
    patch = {"metadata": {"labels": meta["labels"], "ownerReferences": meta["ownerReferences"]}}
    await kube.patch(SECRET, ctx.name, patch, namespace=ctx.namespace)
    return False
