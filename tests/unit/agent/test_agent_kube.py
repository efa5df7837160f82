"""The agent's API client: one kept-alive connection, and a fresh one when it went stale."""

from __future__ import annotations

import http.client
import json
import ssl
from typing import Any

import pytest

from metaroce_agent.kube import KubeClient, KubeError
from metaroce_agent.report import NodeStateWriter
from metaroce_api import MetaRoceNodeStateStatus


class FakeResponse:
    def __init__(self, status: int, body: dict[str, Any], will_close: bool = False) -> None:
        self.status = status
        self._body = json.dumps(body).encode()
        self.will_close = will_close

    def read(self) -> bytes:
        return self._body


class FakeConnection:
    """Answers requests in order from `script`: a response, or an exception to raise."""

    def __init__(self, script: list[Any]) -> None:
        self.script = script
        self.sent: list[tuple[str, str, bytes | None, dict[str, str]]] = []
        self.closed = False

    def request(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> None:
        self.sent.append((method, path, body, headers))

    def getresponse(self) -> FakeResponse:
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        assert isinstance(step, FakeResponse)
        return step

    def close(self) -> None:
        self.closed = True


def client(connections: list[FakeConnection]) -> KubeClient:
    kube = KubeClient("apiserver", 6443, ssl.create_default_context(), token="t")
    made = iter(connections)
    kube._conn = lambda timeout: next(made)  # type: ignore[assignment,method-assign]
    return kube


def test_requests_reuse_one_connection() -> None:
    conn = FakeConnection([FakeResponse(201, {"a": 1}), FakeResponse(200, {"b": 2})])
    kube = client([conn])
    assert kube.create("/apis/x", {"k": "v"}, "metaroce-agent") == {"a": 1}
    assert kube.merge_patch("/apis/x/n", {"status": {}}, "metaroce-agent") == {"b": 2}
    (m1, p1, b1, _), (m2, p2, _, h2) = conn.sent
    assert (m1, p1, json.loads(b1 or b"")) == (
        "POST",
        "/apis/x?fieldManager=metaroce-agent",
        {"k": "v"},
    )
    assert (m2, p2) == ("PATCH", "/apis/x/n?fieldManager=metaroce-agent")
    assert h2["Content-Type"] == "application/merge-patch+json"
    assert h2["Authorization"] == "Bearer t"
    assert not conn.closed


def test_a_stale_connection_is_replaced_once() -> None:
    stale = FakeConnection(
        [FakeResponse(200, {}), http.client.RemoteDisconnected("closed by the server")]
    )
    fresh = FakeConnection([FakeResponse(200, {"ok": True})])
    kube = client([stale, fresh])
    kube.request("GET", "/a")
    assert kube.request("GET", "/b") == {"ok": True}
    assert stale.closed and [s[1] for s in fresh.sent] == ["/b"]


def test_a_fresh_connection_failing_is_an_error() -> None:
    conn = FakeConnection([ConnectionResetError("reset")])
    kube = client([conn])
    with pytest.raises(KubeError, match="cannot reach the apiserver"):
        kube.request("GET", "/a")


def test_api_errors_keep_their_status() -> None:
    kube = client([FakeConnection([FakeResponse(409, {"message": "exists"})])])
    with pytest.raises(KubeError) as err:
        kube.create("/apis/x", {}, "metaroce-agent")
    assert err.value.status == 409 and "exists" in str(err.value)


def test_the_first_report_is_one_post_and_updates_patch_the_object() -> None:
    # Through the real client: a NodeState has no status subresource, so the first report
    # is a single POST with spec and status, a later one a merge patch of the object.
    first = MetaRoceNodeStateStatus.model_validate({"phase": "Pending", "configGeneration": 1})
    created = {"metadata": {"name": "rdma-a.node-1"}, "status": first.to_api()}
    conn = FakeConnection([FakeResponse(201, created), FakeResponse(200, {})])
    writer = NodeStateWriter(client([conn]), "rdma-a", "node-1")
    assert writer.write(first) is True
    ((method, path, body, _),) = conn.sent
    collection = "/apis/metaroce.io/v1alpha1/metarocenodestates"
    assert (method, path) == ("POST", f"{collection}?fieldManager=metaroce-agent")
    sent = json.loads(body or b"")
    assert sent["spec"] == {"network": "rdma-a", "node": "node-1"}
    assert sent["status"] == first.to_api()
    assert writer.requests == 1
    assert writer.write(first.model_copy(update={"phase": "Ready"})) is True
    method, path, body, headers = conn.sent[1]
    assert (method, path) == ("PATCH", f"{collection}/rdma-a.node-1?fieldManager=metaroce-agent")
    assert headers["Content-Type"] == "application/merge-patch+json"
    assert json.loads(body or b"") == {"status": {"phase": "Ready"}}
    assert (writer.requests, writer.writes) == (2, 2)


def test_a_tls_connection_closed_without_close_notify_is_stale_too() -> None:
    # "EOF occurred in violation of protocol": a kept-alive TLS connection the server (or
    # a NAT on the way) dropped; a write on it must go again on a fresh connection
    stale = FakeConnection(
        [FakeResponse(200, {}), ssl.SSLEOFError(8, "EOF occurred in violation of protocol")]
    )
    fresh = FakeConnection([FakeResponse(201, {"ok": True})])
    kube = client([stale, fresh])
    kube.request("GET", "/a")
    assert kube.create("/apis/x", {}, "metaroce-agent") == {"ok": True}
    assert stale.closed and [s[0] for s in fresh.sent] == ["POST"]
