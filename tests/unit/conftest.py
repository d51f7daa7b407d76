"""Unit tests run without Ray: a test that finds a Ray client in its process (left by a
tests/ray fixture in the same session) would test another code path than it names."""

from __future__ import annotations

import sys

import pytest


@pytest.fixture(autouse=True)
def _no_ray_client():
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        pytest.fail("a Ray client is connected in this process before a unit test: tests/unit "
                    "must run before tests/ray (tests/conftest.py KINDS order)")
    yield
