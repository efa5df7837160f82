"""The QMP client against a socket that speaks the protocol as qemu does."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from metaroce_harness.qmp import QmpError, qmp_command


@pytest.fixture
def qemu(tmp_path: Path) -> Iterator[tuple[Path, list[dict[str, object]]]]:
    """A unix socket answering like qemu's QMP: a greeting, then one reply per line,
    with an event before each reply. ``set_link`` on anything but ``l2`` is an error."""
    path = tmp_path / "n1.qmp"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    seen: list[dict[str, object]] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn, conn.makefile("rwb") as f:
            f.write(b'{"QMP": {"version": {}, "capabilities": []}}\r\n')
            f.flush()
            for line in f:
                req = json.loads(line)
                seen.append(req)
                f.write(b'{"event": "NIC_RX_FILTER_CHANGED", "data": {}}\r\n')
                args = req.get("arguments", {})
                if req["execute"] == "set_link" and args.get("name") != "l2":
                    reply = {"error": {"class": "DeviceNotFound", "desc": "no such netdev"}}
                else:
                    reply = {"return": {"ok": req["execute"]}}
                f.write(json.dumps(reply).encode() + b"\r\n")
                f.flush()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield path, seen
    server.close()


def test_a_command_returns_its_return_value_past_events(
    qemu: tuple[Path, list[dict[str, object]]],
) -> None:
    path, seen = qemu
    assert qmp_command(path, "set_link", {"name": "l2", "up": True}) == {"ok": "set_link"}
    assert seen == [
        {"execute": "qmp_capabilities"},
        {"execute": "set_link", "arguments": {"name": "l2", "up": True}},
    ]


def test_an_error_reply_raises_with_its_class_and_text(
    qemu: tuple[Path, list[dict[str, object]]],
) -> None:
    path, _ = qemu
    with pytest.raises(QmpError, match="DeviceNotFound: no such netdev"):
        qmp_command(path, "set_link", {"name": "wan0", "up": True})


def test_a_missing_socket_raises_naming_it(tmp_path: Path) -> None:
    with pytest.raises(QmpError, match=r"QMP set_link on .*gone\.qmp"):
        qmp_command(tmp_path / "gone.qmp", "set_link", {"name": "l2", "up": True})
