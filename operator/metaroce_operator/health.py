"""Liveness, readiness and metrics endpoints (aiohttp on the main event loop).

- /healthz (liveness): the event loop answers and the lease loop ticked recently; a
  wedged loop or a stuck lease task gets the pod restarted.
- /readyz (readiness): the CRDs are installed, the apiserver answered recently and, when
  the replica serves the admission webhooks, it has a serving certificate and its own
  network cache has synced (the webhook Service sends admissions to ready replicas only).
  Followers are ready too: every replica serves the webhooks.
- /metrics on its own port: prometheus-client's exposition of the default registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger("metaroce.operator.health")


@dataclass
class Checks:
    """Each returns (ok, detail)."""

    live: Callable[[], tuple[bool, str]]
    ready: Callable[[], tuple[bool, str]]


def _answer(check: Callable[[], tuple[bool, str]]) -> web.Response:
    ok, detail = check()
    return web.Response(
        status=200 if ok else 503, text=("ok" if ok else "failing") + f": {detail}\n"
    )


async def serve_health(checks: Checks, host: str, port: int) -> web.AppRunner:
    async def healthz(_: web.Request) -> web.Response:
        return _answer(checks.live)

    async def readyz(_: web.Request) -> web.Response:
        return _answer(checks.ready)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", healthz)
    app.router.add_get("/readyz", readyz)
    return await _start(app, host, port, "health")


async def serve_metrics(host: str, port: int) -> web.AppRunner:
    async def metrics(_: web.Request) -> web.Response:
        body = generate_latest(REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    return await _start(app, host, port, "metrics")


async def _start(app: web.Application, host: str, port: int, what: str) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError as err:
        await runner.cleanup()
        raise SystemExit(
            f"cannot serve {what} on {host}:{port}: {err.strerror}; pick another "
            f"--{what}-port (or 0 to turn it off)"
        ) from None
    log.info("serving %s on %s:%d", what, host, port)
    return runner
