"""A minimal client of qemu's machine protocol (QMP) on a guest's unix socket.

The harness uses it for what only qemu can see or do about an emulated NIC: the state
of its virtqueues (``x-query-virtio-queue-status``) and a poke that makes qemu read its
tap again (``set_link``). One connection per command: QMP is line-delimited JSON, a
greeting, ``qmp_capabilities``, then the command; events in between are skipped.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any


class QmpError(Exception):
    """The socket did not answer, or qemu answered with an error."""


def qmp_command(
    path: Path, execute: str, arguments: dict[str, Any] | None = None, timeout: float = 10.0
) -> Any:
    """Run one QMP command on the socket at ``path`` and return its ``return`` value."""
    deadline = time.monotonic() + timeout
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(str(path))
            lines = sock.makefile("rb")
            _reply(lines, deadline, greeting=True)
            sock.sendall(b'{"execute": "qmp_capabilities"}\n')
            _reply(lines, deadline)
            request: dict[str, Any] = {"execute": execute}
            if arguments:
                request["arguments"] = arguments
            sock.sendall(json.dumps(request).encode() + b"\n")
            return _reply(lines, deadline)
    except OSError as exc:
        raise QmpError(f"QMP {execute} on {path}: {exc}") from exc


def _reply(lines: Any, deadline: float, greeting: bool = False) -> Any:
    while time.monotonic() < deadline:
        line = lines.readline()
        if not line:
            raise QmpError("qemu closed the QMP socket")
        msg = json.loads(line)
        if greeting and "QMP" in msg:
            return msg["QMP"]
        if "return" in msg:
            return msg["return"]
        if "error" in msg:
            err = msg["error"]
            raise QmpError(f"{err.get('class')}: {err.get('desc')}")
        # an asynchronous event: not ours
    raise QmpError("no QMP reply in time")
