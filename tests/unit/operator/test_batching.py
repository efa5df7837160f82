"""The status batch loop: many marks, one flush per key per interval."""

from __future__ import annotations

import asyncio
import itertools

from metaroce_operator.status import BatchLoop


def test_a_burst_of_marks_flushes_once_per_interval() -> None:
    async def scenario() -> list[tuple[str, float]]:
        flushed: list[tuple[str, float]] = []
        loop = asyncio.get_running_loop()
        start = loop.time()

        async def flush(key: str) -> None:
            flushed.append((key, loop.time() - start))

        batch = BatchLoop(flush, interval=0.2)
        runner = asyncio.create_task(batch.run())
        for _ in range(1000):  # a rollout: one mark per node event
            batch.mark("net")
            await asyncio.sleep(0.0005)
        await asyncio.sleep(0.5)
        runner.cancel()
        return flushed

    flushed = asyncio.run(scenario())
    times = [t for _, t in flushed]
    assert 2 <= len(flushed) <= 12, flushed
    assert all(b - a >= 0.19 for a, b in itertools.pairwise(times))


def test_keys_are_independent_and_errors_retry() -> None:
    async def scenario() -> dict[str, int]:
        counts = {"a": 0, "b": 0}
        failures = {"b": 1}

        async def flush(key: str) -> None:
            counts[key] += 1
            if failures.get(key):
                failures[key] -= 1
                raise RuntimeError("apiserver hiccup")

        errors: list[str] = []
        batch = BatchLoop(flush, interval=0.05, on_error=lambda k, e: errors.append(k))
        runner = asyncio.create_task(batch.run())
        batch.mark("a")
        batch.mark("b")
        await asyncio.sleep(0.3)
        runner.cancel()
        assert errors == ["b"]
        return counts

    counts = asyncio.run(scenario())
    assert counts == {"a": 1, "b": 2}


def test_idle_loop_does_not_flush() -> None:
    async def scenario() -> int:
        calls = 0

        async def flush(key: str) -> None:
            nonlocal calls
            calls += 1

        batch = BatchLoop(flush, interval=0.01)
        runner = asyncio.create_task(batch.run())
        await asyncio.sleep(0.2)
        runner.cancel()
        return calls

    assert asyncio.run(scenario()) == 0


def test_an_urgent_mark_does_not_wait_out_the_interval() -> None:
    async def scenario() -> list[float]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        flushed: list[float] = []

        async def flush(key: str) -> None:
            flushed.append(loop.time() - start)

        batch = BatchLoop(flush, interval=5.0)
        runner = asyncio.create_task(batch.run())
        batch.mark("net")
        await asyncio.sleep(0.05)
        batch.mark("net")  # an ordinary mark: waits for the interval
        await asyncio.sleep(0.05)
        batch.mark("net", urgent=True)  # the last node reported: flush now
        await asyncio.sleep(0.05)
        runner.cancel()
        return flushed

    flushed = asyncio.run(scenario())
    assert len(flushed) == 2 and flushed[1] < 0.5, flushed


def test_a_key_forgotten_before_the_loop_wakes_is_not_an_error() -> None:
    # a network marked and then forgotten (its deletion released) in one go, while the
    # loop waited with nothing dirty: it woke to an empty set and died on min() of it,
    # which stopped the controller and ended the leadership term (CI, 2026-12-03)
    async def scenario() -> tuple[bool, int]:
        calls = 0

        async def flush(key: str) -> None:
            nonlocal calls
            calls += 1

        batch = BatchLoop(flush, interval=0.05)
        runner = asyncio.create_task(batch.run())
        await asyncio.sleep(0.01)  # the loop waits: nothing dirty
        batch.mark("gone")
        batch.forget("gone")
        await asyncio.sleep(0.05)
        batch.mark("net")
        await asyncio.sleep(0.05)
        alive = not runner.done()
        runner.cancel()
        return alive, calls

    alive, calls = asyncio.run(scenario())
    assert alive and calls == 1
