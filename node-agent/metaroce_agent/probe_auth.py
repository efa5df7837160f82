"""Authentication of the probe side channel: HMAC-SHA256 keyed by the network's probe key.

The key is a per-network Secret mounted into the agents (`DEFAULT_KEY_FILE`); a token in
the NodeState would be readable by anyone with `view`. A session is a challenge and a
response each way: the server opens with a fresh nonce, the client's hello carries its
own nonce and a MAC over both nonces and every field of the hello, and the server's
reply carries a MAC over both nonces and its fields (so each side knows the other holds
the key, and a recorded session cannot be replayed: the other side's nonce is new). The
count reply, which decides the loss verdict, is MACed the same way.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path
from typing import Any

DEFAULT_KEY_FILE = Path("/etc/metaroce/probe/key")
MIN_KEY_BYTES = 16
NONCE_BYTES = 16


class ProbeKeyError(ValueError):
    pass


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def _canonical(fields: dict[str, Any]) -> bytes:
    body = {k: v for k, v in fields.items() if k != "mac"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def sign(
    key: bytes, role: str, server_nonce: str, client_nonce: str, fields: dict[str, Any]
) -> str:
    """The MAC of one message: `role` (client, server, count) keeps a message of one kind
    from being accepted as another."""
    msg = b"\n".join([b"metaroce-probe/2", role.encode(), server_nonce.encode(),
                      client_nonce.encode(), _canonical(fields)])  # fmt: skip
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def verify(
    key: bytes, mac: object, role: str, server_nonce: str, client_nonce: str, fields: dict[str, Any]
) -> bool:
    if not isinstance(mac, str):
        return False
    return hmac.compare_digest(mac, sign(key, role, server_nonce, client_nonce, fields))


def load_key(path: Path) -> bytes | None:
    """The key in `path` (surrounding whitespace dropped), None when there is no such file.
    Read per session, so a rotated Secret takes effect without a restart."""
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ProbeKeyError(f"probe key {path}: cannot read it: {e.strerror}") from e
    if len(key) < MIN_KEY_BYTES:
        raise ProbeKeyError(
            f"probe key {path}: {len(key)} bytes, at least {MIN_KEY_BYTES} bytes needed: put "
            f"a random key in the network's probe Secret (e.g. `openssl rand -hex 32`)"
        )
    return key
