"""Shared fixtures: one local Ray instance for the whole test session.

Starting Ray costs ~10 s on a 2-core machine, so every test that only needs "a Ray" shares
this one. Tests that need their own cluster (several raylets, network namespaces, a fixed
metrics port) start it in a subprocess or their own fixture and never call ray.init here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

LOCAL_RAY_CPUS = 8
TESTS_DIR = Path(__file__).resolve().parent
HELPERS_DIR = TESTS_DIR / "helpers"
# One folder per kind of test; the folder name is also the marker each test gets. A run goes
# in this order: fast kinds first, and tests/ray last, because its shared Ray (``ray_local``)
# lives until the session ends: a unit test must never see a Ray client in its process (it
# changes what check_storage probes and which threads a snapshot lists), and the netns
# clusters must not share the 2 cores with an idle local Ray.
KINDS = ("unit", "dist", "netns", "ray")
SERIAL = "serial"  # the xdist group of every kind but unit
sys.path.insert(0, str(HELPERS_DIR))  # the tests' own drivers, train functions and fixtures
# harness/ (what tests and benchmarks share) and benchmarks/ import from the repository root,
# as under `python -m pytest` there; this makes a plain `pytest` (or another cwd) alike.
REPO_DIR = TESTS_DIR.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(1, str(REPO_DIR))

from require_all import (  # noqa: E402 - a hook pytest finds here; CI fails on skips
    SLOW_ENV,
    SLOW_REASON,
    pytest_runtest_makereport,  # noqa: F401
)


def worker_runtime_env() -> dict:
    """Lets Ray workers import train functions defined in test modules and ``harness``
    (by module name)."""
    dirs = [str(TESTS_DIR / kind) for kind in KINDS] + [str(HELPERS_DIR), str(REPO_DIR)]
    path = os.pathsep.join(p for p in (*dirs, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def missing_kinds(config, items) -> list[str]:
    """The kinds' folders a run over the whole of tests/ collected nothing from.

    pytest's default ``norecursedirs`` holds "dist", which once kept tests/dist out of every
    run without a word; a whole-suite run (no paths, -k or -m given) now fails instead.
    """
    asked = [Path(a).resolve() for a in config.args]
    if asked != [TESTS_DIR] or config.option.keyword or config.option.markexpr:
        return []
    seen = {item_kind(item) for item in items}
    return [kind for kind in KINDS if any((TESTS_DIR / kind).glob("test_*.py"))
            and kind not in seen]


def item_kind(item) -> str:
    """The kind of a test: the name of its folder."""
    return Path(str(item.fspath)).parent.name


def kind_order(item) -> int:
    """Where an item's kind comes in a run (KINDS order; anything else last)."""
    kind = item_kind(item)
    return KINDS.index(kind) if kind in KINDS else len(KINDS)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """The kinds' markers and order; every kind but unit in one xdist group ("serial": one
    worker, in order, as without xdist: Ray and the virtual clusters take the whole machine,
    and only unit tests run side by side); ``@pytest.mark.slow`` tests (multi-minute
    scenarios) run only with RAY_MESH_SLOW_TESTS=1."""
    if missing := missing_kinds(config, items):
        raise pytest.UsageError(
            f"tests/{', tests/'.join(missing)} collected no test in a whole-suite run: check "
            "[tool.pytest.ini_options] norecursedirs in pyproject.toml (pytest's default "
            "skips folders named dist and build)")
    for item in items:  # the folder says the kind: `pytest -m unit`, `-m "not netns"`, ...
        kind = item_kind(item)
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
        if kind != "unit":
            item.add_marker(pytest.mark.xdist_group(SERIAL))
    items.sort(key=kind_order)  # stable: the order inside a kind is pytest's
    if os.environ.get(SLOW_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=SLOW_REASON)
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """A local Ray with 8 logical CPUs (enough for 8 workers of CPU=1 on a 2-core box)."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # Checkpoints in a bucket (tests/ray/test_checkpoint_s3_ray.py, a moto server): every Ray
    # process resolves AWS credentials from its environment, inherited from here. moto checks
    # none, but without any pyarrow uploads anonymously and moto stores the chunk framing.
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_EC2_METADATA_DISABLED", "true")):
        os.environ.setdefault(key, value)
    if ray.is_initialized():
        ray.shutdown()
    ray.init(address="local", num_cpus=LOCAL_RAY_CPUS, include_dashboard=False,
             runtime_env=worker_runtime_env(), _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield ray
    ray.shutdown()


@pytest.fixture
def storage(tmp_path):
    """A storage_path for RunConfig, private to the test."""
    return str(tmp_path / "results")
