"""Authentication of the probe side channel: HMAC-SHA256 keyed by the network's probe key.

The key is a per-network Secret mounted into the agents (`DEFAULT_KEY_FILE`); a token in
the NodeState would be readable by anyone with `view`. A session is a challenge and a
response each way: the server opens with a fresh nonce, the client's hello carries its
own nonce and a MAC over both nonces and every field of the hello, and the server's
reply carries a MAC over both nonces and its fields (so each side knows the other holds
the key, and a recorded session cannot be replayed: the other side's nonce is new). The
count reply, which decides the loss verdict, is MACed the same way.

Rotation (the operator's probe Secret, `key` and `previous`): an agent holds up to two
keys, the current one and the one before it. The server's challenge names the ids of the
keys it holds (`kids`, a hash that reveals nothing of a key), the client answers with
the first of its own keys the server holds, and the server checks the hello against
each of its keys and signs its replies with the one that matched. So while a rotated
Secret reaches the nodes one by one (the kubelet refreshes a mounted Secret within about
a minute), an updated agent (new, old) and one not yet updated (old) still agree on the
old key, and nothing looks unreachable.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from pathlib import Path
from typing import Any

DEFAULT_KEY_FILE = Path("/etc/metaroce/probe/key")
PREVIOUS_KEY_FILE = "previous"
"""Beside the key file: the key before the last rotation, still accepted."""
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


def load_keys(path: Path) -> tuple[bytes, ...]:
    """The keys an agent holds: the one in `path`, then the previous one (the file
    `previous` beside it) when there is one and it differs; () without a key file."""
    key = load_key(path)
    if key is None:
        return ()
    previous = load_key(path.with_name(PREVIOUS_KEY_FILE))
    return (key,) if previous is None or previous == key else (key, previous)


def key_id(key: bytes) -> str:
    """A short public id of a key (a hash of it: naming it reveals nothing)."""
    return hashlib.sha256(b"metaroce-probe-kid\n" + key).hexdigest()[:16]


def choose_key(mine: tuple[bytes, ...], theirs: object) -> bytes:
    """The first of `mine` whose id is in the server's `kids` (`theirs`); the first of
    `mine` when the server names none (an older agent) or none matches (then the session
    fails authentication, as it must)."""
    if isinstance(theirs, list):
        for key in mine:
            if key_id(key) in theirs:
                return key
    return mine[0]
