"""Fixtures of the operator's unit tests."""

from __future__ import annotations

import pytest

from metaroce_operator.settings import RenderSettings


@pytest.fixture
def settings() -> RenderSettings:
    return RenderSettings(namespace="metaroce-system", agent_image="example.com/agent:v1")
