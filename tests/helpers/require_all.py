"""A pytest plugin: in CI, a skipped test fails (no silent coverage loss).

The suite skips what the machine cannot run: the namespace tests without root or ``ip``,
the shellcheck test without shellcheck, ... Locally that is convenient; in CI it would turn
"green" into "green for the part that ran". With ``CI=true`` (GitHub Actions, GitLab and
most CI systems set it) or ``RAY_MESH_REQUIRE_ALL=1``, every skip becomes a failure that
names what is missing and how to provide it. The one exception is the opt-in slow tier
(``@pytest.mark.slow`` without ``RAY_MESH_SLOW_TESTS=1``): a choice, not a missing tool.

``tests/conftest.py`` imports the hook; ``python -m pytest -p require_all`` loads it alone.
"""

from __future__ import annotations

import os

import pytest

SLOW_ENV = "RAY_MESH_SLOW_TESTS"
REQUIRE_ALL_ENV = "RAY_MESH_REQUIRE_ALL"
SLOW_REASON = f"slow scenario: set {SLOW_ENV}=1 to run it"


def require_all() -> bool:
    """True in CI (``CI=true``) or with ``RAY_MESH_REQUIRE_ALL=1``."""
    return (os.environ.get(REQUIRE_ALL_ENV) == "1"
            or os.environ.get("CI", "").strip().lower() in ("true", "1", "yes"))


def _opted_out(item: pytest.Item) -> bool:
    """The one skip that is a choice, not a missing capability: slow tests without opt-in."""
    return "slow" in item.keywords and os.environ.get(SLOW_ENV) != "1"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Under :func:`require_all`, a skip fails the test with its reason and the fix."""
    outcome = yield
    rep = outcome.get_result()
    if not rep.skipped or hasattr(rep, "wasxfail") or _opted_out(item) or not require_all():
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    reason = reason.removeprefix("Skipped: ")
    rep.outcome = "failed"
    rep.longrepr = (
        f"{item.nodeid} was skipped ({reason}), but this run must run every test "
        f"(CI=true or {REQUIRE_ALL_ENV}=1). Provide what the reason names (.ci/run runs as "
        f"root and installs shellcheck, iproute2, chromium, nftables and iptables with "
        f"apt-get), or unset CI and {REQUIRE_ALL_ENV} for a local run that may skip.")
