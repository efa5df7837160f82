"""Shared pytest set-up: tier markers follow the folder a test lives in."""

from __future__ import annotations

from pathlib import Path

import pytest

_TIERS = {"unit", "integration", "e2e", "transport", "fault"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = set(Path(str(item.path)).parts)
        for tier in _TIERS & parts:
            if tier != "unit":
                item.add_marker(getattr(pytest.mark, tier))
