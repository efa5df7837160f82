"""The operator process: endpoints, leader election, and one kopf run per leadership term.

Every replica serves health and metrics, serves the admission webhooks from its own
watch of the networks (`--webhook-port`; admission never depends on who leads), and
competes for the Lease. The winner starts a `Controller` and kopf (on its own thread, see
`kopfrun`) and, unless cert-manager owns them, keeps the webhook certificate Secret and
the caBundles valid; when the lease is lost the write gate closes at once, the
controller's tasks are cancelled and kopf is stopped, and the replica goes back to being
a candidate. SIGTERM releases the lease so a follower takes over without waiting for it
to expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

from aiohttp import web

from metaroce_api import constants as c
from metaroce_operator import __version__, metrics
from metaroce_operator.bridge import Bridge
from metaroce_operator.controller import Controller
from metaroce_operator.health import Checks, serve_health, serve_metrics
from metaroce_operator.kopfrun import KopfThread
from metaroce_operator.kube import ApiError, Kube, NotLeader, load_credentials
from metaroce_operator.leader import LeaderElector
from metaroce_operator.settings import OperatorSettings

if TYPE_CHECKING:
    from metaroce_operator.webhooks.server import WebhookApp

log = logging.getLogger("metaroce.operator")


class Process:
    def __init__(self, settings: OperatorSettings) -> None:
        self.settings = settings
        self.creds = load_credentials(settings.kubeconfig)
        self.kube = Kube(
            self.creds, user_agent=f"metaroce-operator/{__version__} ({settings.identity})"
        )
        # The lease has a client (connections) of its own: renewals never queue behind
        # the controller's requests.
        self.lease_kube = Kube(
            self.creds, user_agent=f"metaroce-operator/{__version__} ({settings.identity}) lease"
        )
        self.elector = LeaderElector(
            self.lease_kube,
            namespace=settings.lease_namespace,
            name=settings.lease_name,
            identity=settings.identity,
            lease_duration=settings.lease_duration,
            renew_deadline=settings.renew_deadline,
            retry_period=settings.retry_period,
        )
        self.stop = asyncio.Event()
        self.crds_found = False
        self.runners: list[web.AppRunner] = []
        self.webhook: WebhookApp | None = None

    # -- probes ------------------------------------------------------------------------------

    def live(self) -> tuple[bool, str]:
        age = self.elector.clock() - self.elector.heartbeat
        limit = max(30.0, 3 * self.settings.lease_duration)
        return age < limit, f"lease loop ticked {age:.1f}s ago"

    def ready(self) -> tuple[bool, str]:
        if not self.crds_found:
            return (
                False,
                "the MetaRoCE CRDs are not installed (kubectl apply --server-side -f crds/)",
            )
        age = self.elector.clock() - self.elector.last_contact
        limit = max(3 * self.settings.lease_duration, 30.0)
        role = "leader" if self.elector.is_leader() else f"follower of {self.elector.holder!r}"
        detail = f"{role}; apiserver answered {age:.1f}s ago"
        if self.webhook is not None:
            serving, why = self.webhook.ready()
            detail += f"; {why}"
            if not serving:
                return False, detail
        return age < limit, detail

    # -- webhooks --------------------------------------------------------------------------

    def _start_webhook(self) -> None:
        """Serve the webhooks in every replica (threads of their own: the stdlib server
        blocks; its API reads run on a loop of its own, see webhooks.apiloop)."""
        from metaroce_operator.webhooks.server import AppOptions, WebhookApp, tune_for_latency

        w = self.settings.webhook
        namespace, _ = w.secret_ref
        options = AppOptions(
            cert_secret=w.cert_secret,
            manage_certs=False,  # the leader rotates: see _lead_certificates
            service=w.service or "",
            service_namespace=namespace,
            mutating_configs=(w.mutating_config,) if w.mutating_config else (),
            validating_configs=(w.validating_config,) if w.validating_config else (),
            address=self.settings.bind_address,
            port=w.port,
            allowed_agent_images=self.settings.render.allowed_agent_images,
            attachment_namespace=self.settings.render.namespace,
        )
        app = WebhookApp(options, self.creds)
        self.webhook = app

        def serve() -> None:
            try:
                app.start(wait_certificates=None)
                tune_for_latency()
            except OSError as err:
                metrics.ERRORS.labels(where="webhook").inc()
                log.error(
                    "cannot serve the webhooks on %s:%d: %s; pick another --webhook-port "
                    "(this replica stays unready)",
                    options.address,
                    options.port,
                    err.strerror or err,
                )
            except Exception as err:
                metrics.ERRORS.labels(where="webhook").inc()
                log.error(
                    "the webhook server failed to start: %r (this replica stays unready)", err
                )

        threading.Thread(target=serve, name="webhook-start", daemon=True).start()

    async def _lead_certificates(self, kube: Kube) -> None:
        """Leader: create/rotate the certificate Secret and write the caBundles, now and
        every `cert_check_interval` (configurations the chart installs later get theirs).
        On this loop, through the leader's gated client: no write after the lease is lost
        (a thread with a client of its own could not be stopped or gated so)."""
        assert self.webhook is not None
        app, interval = self.webhook, self.settings.webhook.cert_check_interval
        while True:
            delay = interval
            if self.elector.is_leader():
                try:
                    changed = await app.rotate_certificates(kube)
                    if changed:
                        log.info("webhook certificates: %s", changed)
                except NotLeader:
                    pass  # the lease was just lost: the term is ending
                except Exception as err:
                    metrics.ERRORS.labels(where="webhook-certs").inc()
                    log.warning("webhook certificates: %s; retrying in 5 s", err)
                    delay = 5.0
            await asyncio.sleep(delay)

    # -- run -----------------------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop.set)
        s = self.settings
        try:
            if s.health_port:
                checks = Checks(live=self.live, ready=self.ready)
                self.runners.append(await serve_health(checks, s.bind_address, s.health_port))
            if s.metrics_port:
                self.runners.append(await serve_metrics(s.bind_address, s.metrics_port))
            metrics.LEADER.set(0)
            if s.webhook.enabled:
                self._start_webhook()
            await self._wait_for_crds()
            while not self.stop.is_set():
                if not await self.elector.acquire(self.stop):
                    break
                await self._lead()
        finally:
            await self.elector.release()
            for runner in self.runners:
                await runner.cleanup()
            await self.kube.close()
            await self.lease_kube.close()
            if self.webhook is not None:
                # Last: admission keeps working while the lease is handed over.
                await asyncio.to_thread(self.webhook.stop)
        log.info("stopped")
        return 0

    async def _wait_for_crds(self) -> None:
        path = f"/apis/{c.API_VERSION}"
        announced = False
        while not self.stop.is_set():
            try:
                found = await self.kube.request("GET", path)
                plurals = {r.get("name") for r in found.get("resources") or []}
                if {c.NETWORK_PLURAL, c.NODESTATE_PLURAL} <= plurals:
                    self.crds_found = True
                    self.elector.last_contact = self.elector.clock()
                    return
            except ApiError as err:
                if err.status != 404:
                    log.warning("checking for the CRDs: %s", err)
            except OSError as err:
                log.warning("the apiserver is not reachable: %s", err)
            if not announced:
                log.warning(
                    "the %s CRDs are not installed yet; waiting (kubectl apply --server-side "
                    "-f crds/)",
                    c.GROUP,
                )
                announced = True
            self.elector.heartbeat = self.elector.clock()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.retry_period)

    async def _lead(self) -> None:
        """One leadership term: until the lease is lost, kopf fails, or we are stopped."""
        loop = asyncio.get_running_loop()
        gate = self.elector.is_leader
        controller = Controller(self.kube.gated(gate), self.settings)
        kopf_thread = KopfThread(
            Bridge(loop, controller, self.creds, gate), self.settings.render.namespace
        )
        kopf_thread.start()
        tasks: dict[str, asyncio.Task[Any]] = {
            "lease lost": loop.create_task(self.elector.hold(), name="lease"),
            "controller stopped": loop.create_task(controller.run(), name="controller"),
            "kopf stopped": loop.create_task(kopf_thread.wait(), name="kopf"),
            "asked to stop": loop.create_task(self.stop.wait(), name="stop"),
        }
        if self.webhook is not None and not self.settings.webhook.cert_manager:
            tasks["webhook certificates stopped"] = loop.create_task(
                self._lead_certificates(controller.kube), name="webhook-certs"
            )
        done, _ = await asyncio.wait(tasks.values(), return_when=asyncio.FIRST_COMPLETED)
        reasons = [why for why, task in tasks.items() if task in done]
        log.info("leadership term ends: %s", ", ".join(reasons))
        controller.close()
        for task in tasks.values():
            task.cancel()
        for why, task in tasks.items():
            with contextlib.suppress(asyncio.CancelledError):
                try:
                    await task
                except Exception as err:
                    metrics.ERRORS.labels(where="term").inc()
                    # with the traceback: the repr of an ExceptionGroup names no line
                    log.error("%s: %r", why, err, exc_info=err)
        await kopf_thread.stop()
        if self.elector.is_leader() and not self.stop.is_set():
            # kopf or the controller died while we still lead: hand over rather than limp on.
            await self.elector.release()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.lease_duration)


def run(settings: OperatorSettings) -> int:
    return asyncio.run(Process(settings).run())
