"""Waiting for a condition, the one way tests, benchmarks and the demo do it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(what: str, check: Callable[[], T], timeout: float = 60, every: float = 0.25) -> T:
    """Call `check` until it returns something truthy and return that; fail naming `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)
