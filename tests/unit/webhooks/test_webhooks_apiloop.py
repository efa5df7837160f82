"""The webhook's API loop (issue 16, one client stack): server threads run coroutines on
the webhook's own loop and wait for them; a call that outlives its timeout fails, and
the loop's watches end with it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from metaroce_operator.kube import Credentials, Kube
from metaroce_operator.webhooks.apiloop import ApiLoop


def test_calls_run_on_the_loop_thread_and_return_their_result() -> None:
    api = ApiLoop(Credentials(server="https://127.0.0.1:1"))
    try:
        seen: list[str] = []

        async def answer(kube: Kube) -> int:
            seen.append(threading.current_thread().name)
            assert kube is api.kube
            await asyncio.sleep(0)
            return 42

        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(api.call(answer, timeout=5)))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert results == [42] * 4 and set(seen) == {"webhook-api"}
    finally:
        api.stop()


def test_a_call_that_outlives_its_timeout_fails_and_stop_ends_the_watches() -> None:
    api = ApiLoop(Credentials(server="https://127.0.0.1:1"))
    ended = threading.Event()

    async def forever(kube: Kube) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    try:
        with pytest.raises(TimeoutError, match=r"within 0\.1 s"):
            api.call(forever, timeout=0.1)
        api.spawn(forever)
    finally:
        api.stop()
    assert ended.wait(5)
    assert api.loop.is_closed()
