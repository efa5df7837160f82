"""The failpoint switch the fault tier uses."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metaroce_api import failpoints


def test_unset_does_nothing() -> None:
    failpoints.reset("")
    for _ in range(3):
        failpoints.failpoint("apply.after_step")


def test_error_from_the_nth_hit_on() -> None:
    failpoints.reset("apply.step=2:error")
    try:
        failpoints.failpoint("apply.step")
        for _ in range(2):
            with pytest.raises(failpoints.FailpointError, match=r"apply\.step"):
                failpoints.failpoint("apply.step")
    finally:
        failpoints.reset("")


def test_error_k_times_from_the_nth_hit_then_passes() -> None:
    failpoints.reset("informer.before_list=2:error=3")
    try:
        raised = []
        for _ in range(6):
            try:
                failpoints.failpoint("informer.before_list")
            except failpoints.FailpointError:
                raised.append(True)
            else:
                raised.append(False)
        assert raised == [False, True, True, True, False, False]
    finally:
        failpoints.reset("")


def test_kill_is_sigkill_at_the_nth_hit() -> None:
    code = (
        "from metaroce_api.failpoints import failpoint\n"
        "failpoint('x'); print('first', flush=True); failpoint('x'); print('second')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={"METAROCE_FAILPOINTS": "x=2", "PYTHONPATH": ":".join(sys.path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == -9 and proc.stdout == "first\n"
    assert "failpoint x (hit 2, METAROCE_FAILPOINTS): SIGKILL" in proc.stderr


@pytest.mark.parametrize(
    "spec", ["x", "x=0", "x=two", "=1", "x=1:explode", "x=1:error=0", "x=1:error=", "x=1:kill=2"]
)
def test_bad_specs_name_the_variable(spec: str) -> None:
    with pytest.raises(ValueError, match="METAROCE_FAILPOINTS"):
        failpoints.parse(spec)
