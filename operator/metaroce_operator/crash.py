"""TEST ONLY: kill points for the restart-safety tests.

With METAROCE_TEST_CRASH_AT=<point> in its environment, the operator exits abruptly
(`os._exit(1)`: no cleanup, no lease release, like a SIGKILL or an OOM kill) the first
time it reaches that point. Points: after-configmap, after-daemonset (in reconcile, after
that child was applied) and during-status (in status aggregation, before the write). A
restarted operator without the variable must converge to the same objects.
"""

from __future__ import annotations

import os
import sys
from typing import Final

ENV: Final = "METAROCE_TEST_CRASH_AT"
POINTS: Final = ("after-configmap", "after-daemonset", "during-status")


def point(name: str) -> None:
    """Exit the process here if the test asked for it."""
    if name not in POINTS:
        raise ValueError(f"unknown crash point {name!r}")
    if os.environ.get(ENV) == name:
        sys.stderr.write(f"metaroce-operator: {ENV}={name}: exiting abruptly (test kill point)\n")
        sys.stderr.flush()
        os._exit(1)


def check_env() -> None:
    """Refuse a misspelt kill point instead of silently never crashing."""
    value = os.environ.get(ENV)
    if value and value not in POINTS:
        raise SystemExit(f"{ENV}={value!r}: choose one of {', '.join(POINTS)} (or unset it)")
