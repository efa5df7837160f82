"""Fixtures of the e2e tier: real SoftRoCE (rdma_rxe) in qemu guests.

The tier never skips: a missing guest image is built here (hack/build-guest.sh, which
also installs qemu), and anything that cannot be built or booted is an error naming its
log file. One two-guest cluster is shared by the whole session (``guests``); the
single-guest tests use its first guest (``node1``), or boot one guest of their own when
no two-guest test is selected. After the session, no qemu process or run
directory of this process may be left: the session fails otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from metaroce_harness.guests import (
    Guest,
    GuestCluster,
    GuestImage,
    boot_history,
    find_image,
    leftovers,
)

# The tests import their helpers from e2e_support.py next to this file, whatever
# pytest's import mode.
if str(Path(__file__).parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def guest_image() -> GuestImage:
    logging.getLogger("metaroce.guests").setLevel(logging.INFO)
    # Builds the image on first use (minutes), reuses it afterwards (about a second).
    return find_image(build=True)


@pytest.fixture(scope="session")
def guests(guest_image: GuestImage) -> Iterator[GuestCluster]:
    with GuestCluster(count=2, memory_mb=1024, image=guest_image) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def node1(request: pytest.FixtureRequest, guest_image: GuestImage) -> Iterator[Guest]:
    """One guest: the first of ``guests`` when the session also runs two-guest tests
    (one boot for all), else a cluster of its own with a single guest."""
    if any("guests" in item.fixturenames for item in request.session.items):
        cluster: GuestCluster = request.getfixturevalue("guests")
        yield cluster[0]
        return
    with GuestCluster(count=1, memory_mb=1024, image=guest_image) as single:
        yield single[0]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a qemu process or run directory of this process survived it."""
    left = leftovers(owner_pid=os.getpid())
    if left:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "e2e: left behind after the session:\n  " + "\n  ".join(left)
        if reporter is not None:
            reporter.write_line(message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long the guests took to boot (the harness records every boot)."""
    if not boot_history:
        return
    terminalreporter.section("guest boots")
    for count, total, per_guest, attempts in boot_history:
        guests = ", ".join(
            f"node-{i + 1} {s:.1f} s" + (f" ({a} attempts)" if a > 1 else "")
            for i, (s, a) in enumerate(zip(per_guest, attempts, strict=True))
        )
        terminalreporter.write_line(f"{count} guest(s) in {total:.1f} s: {guests}")
