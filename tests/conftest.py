"""Shared fixtures: one local Ray instance for the whole test session.

Starting Ray costs ~10 s on a 2-core machine, so every test that only needs "a Ray" shares
this one. Tests that need their own cluster (several raylets, network namespaces, a fixed
metrics port) start it in a subprocess or their own fixture and never call ray.init here.
"""

from __future__ import annotations

import os
import sys
import tempfile
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
HEAVY = KINDS[1:]  # one at a time (tests/helpers/heavy.py), the unit tests beside them
HEAVY_FILES_SHOWN = 20  # the heavy files named in the summary, longest first
sys.path.insert(0, str(HELPERS_DIR))  # the tests' own drivers, train functions and fixtures
# harness/ (what tests and benchmarks share) and benchmarks/ import from the repository root,
# as under `python -m pytest` there; this makes a plain `pytest` (or another cwd) alike.
REPO_DIR = TESTS_DIR.parent
if str(REPO_DIR) not in sys.path:
    sys.path.insert(1, str(REPO_DIR))

import heavy  # noqa: E402 - tests/helpers
import streams  # noqa: E402
from require_all import (  # noqa: E402 - a hook pytest finds here; CI fails on skips
    SLOW_ENV,
    SLOW_REASON,
    pytest_runtest_makereport,  # noqa: F401
)

_STREAM = pytest.StashKey[streams.UnitStream]()  # the parent's unit stream, if any


def worker_runtime_env() -> dict:
    """Lets Ray workers import train functions defined in test modules and ``harness``
    (by module name)."""
    dirs = [str(TESTS_DIR / kind) for kind in KINDS] + [str(HELPERS_DIR), str(REPO_DIR)]
    path = os.pathsep.join(p for p in (*dirs, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def whole_suite(config) -> bool:
    """A run over all of tests/ (no paths, -k or -m given)."""
    asked = [Path(a).resolve() for a in config.args]
    return asked == [TESTS_DIR] and not config.option.keyword and not config.option.markexpr


def missing_kinds(config, items) -> list[str]:
    """The kinds' folders a run over the whole of tests/ collected nothing from.

    pytest's default ``norecursedirs`` holds "dist", which once kept tests/dist out of every
    run without a word; a whole-suite run (no paths, -k or -m given) now fails instead.
    """
    if not whole_suite(config):
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


def pytest_configure(config):
    """One heavy-test journal for every process of the run; in the unit stream's child, its
    reports file (taken out of the environment, so no test's own pytest child writes there)."""
    os.environ.setdefault(heavy.JOURNAL_ENV, os.path.join(
        tempfile.mkdtemp(prefix="ray_mesh_heavy_"), "journal.jsonl"))
    reports = os.environ.get(streams.STREAM_ENV, "")
    if reports and reports != "0":  # "0" stays: the user's opt-out, read at collection
        del os.environ[streams.STREAM_ENV]
        config.pluginmanager.register(streams.ReportWriter(config, reports))


def pytest_collection_modifyitems(config, items):
    """The kinds' markers and order; the unit tests to a child of their own in a whole-suite
    run (tests/helpers/streams.py); ``@pytest.mark.slow`` tests (multi-minute scenarios) run
    only with RAY_MESH_SLOW_TESTS=1."""
    if missing := missing_kinds(config, items):
        raise pytest.UsageError(
            f"tests/{', tests/'.join(missing)} collected no test in a whole-suite run: check "
            "[tool.pytest.ini_options] norecursedirs in pyproject.toml (pytest's default "
            "skips folders named dist and build)")
    for item in items:  # the folder says the kind: `pytest -m unit`, `-m "not netns"`, ...
        kind = item_kind(item)
        if kind in KINDS:
            item.add_marker(getattr(pytest.mark, kind))
    items.sort(key=kind_order)  # stable: the order inside a kind is pytest's
    if os.environ.get(SLOW_ENV) != "1":
        skip = pytest.mark.skip(reason=SLOW_REASON)
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    unit = [item for item in items if item_kind(item) == "unit"]
    if (whole_suite(config) and os.environ.get(streams.STREAM_ENV) != "0"
            and not config.option.collectonly and not hasattr(config, "workerinput")
            and unit and len(unit) < len(items)):
        items[:] = [item for item in items if item_kind(item) != "unit"]
        config.stash[_STREAM] = streams.UnitStream(
            config, unit, TESTS_DIR / "unit",
            Path(tempfile.mkdtemp(prefix="ray_mesh_unit_stream_")))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A heavy test holds the machine-wide lock from its setup to its teardown (session
    fixtures' start and stop included); the unit stream's new reports are logged after it."""
    try:
        if item_kind(item) in HEAVY:
            journal = Path(os.environ[heavy.JOURNAL_ENV])
            with heavy.alone(item.nodeid, journal, say=_say(item.config)):
                return (yield)
        return (yield)
    finally:
        if stream := item.config.stash.get(_STREAM, None):
            stream.drain()


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session):
    """After the heavy kinds: the unit stream's end, then the overlap check of the journal."""
    config = session.config
    stream = config.stash.get(_STREAM, None)
    if stream:  # the progress figures count the unit tests the child runs
        session.testscollected += len(stream.items)
    try:
        result = yield
    except BaseException:
        if stream:
            stream.stop()
        raise
    if stream:
        stream.finish(say=_say(config))
    if not hasattr(config, "workerinput"):
        _check_overlaps(config)
    _check_warnings(config)
    return result


_WARNED: list[str] = []  # this process's warnings (the unit stream's child has its own)


def pytest_warning_recorded(warning_message, when, nodeid, location):
    _WARNED.append(f"{nodeid or when}: {warning_message.category.__name__}: "
                   f"{warning_message.message}")


def _check_warnings(config) -> None:
    """A warning on the suite's console is a defect (the product's or a test's): the run
    fails, naming each, instead of leaving them in a summary nobody reads. A warning raised
    inside a dependency that a user's console would not show is filtered in pyproject.toml
    with the reason beside it."""
    if not _WARNED:
        return
    location = ("tests/conftest.py", None, "no warnings")
    streams.log_failure(config, "tests/conftest.py::no_warnings", location,
                        f"{len(_WARNED)} warning(s) during the run:\n" + "\n".join(_WARNED))


def _say(config):
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    return (lambda text: reporter.write_line(text.strip())) if reporter else print


def _check_overlaps(config) -> None:
    """Fail the run, naming them, when two heavy tests overlapped (tests/helpers/heavy.py)."""
    pairs = heavy.overlaps(heavy.read(Path(os.environ[heavy.JOURNAL_ENV])))
    if not pairs:
        return
    location = ("tests/conftest.py", None, "heavy tests run one at a time")
    nodeid = "tests/conftest.py::heavy_tests_run_one_at_a_time"
    message = (f"{len(pairs)} pair(s) of heavy tests (dist, netns, ray) overlapped in time; "
               "they must run one at a time (run the suite as README.md says: one "
               "`python -m pytest`, no -n):\n" + heavy.describe(pairs))
    streams.log_failure(config, nodeid, location, message)


def pytest_terminal_summary(terminalreporter):
    """Where the time went, by kind and by heavy file: the sum of each test's setup, call
    and teardown (CI's log keeps only this summary: the heavy files are the suite's wall)."""
    spent: dict[str, float] = {}
    files: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                kind = Path(report.location[0]).parent.name
                spent[kind] = spent.get(kind, 0.0) + report.duration
                if kind in HEAVY:
                    name = report.location[0].removeprefix("tests/")
                    files[name] = files.get(name, 0.0) + report.duration
    if spent:
        parts = ", ".join(f"{kind} {spent[kind]:.0f} s" for kind in
                          sorted(spent, key=lambda k: KINDS.index(k) if k in KINDS else 9))
        terminalreporter.write_line(f"time by kind (setup + call + teardown): {parts}")
    if files:
        top = sorted(files.items(), key=lambda kv: -kv[1])[:HEAVY_FILES_SHOWN]
        terminalreporter.write_line("heavy files by time: " + ", ".join(
            f"{name} {t:.0f} s" for name, t in top))


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory):
    """A local Ray with 8 logical CPUs (enough for 8 workers of CPU=1 on a 2-core box)."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    # What `ray-mesh run` sets for every job (ray_mesh.raytrain.driver.CLI_ENV): Ray Train's
    # controller looks at its workers every 0.2 s instead of 2 s, so a run that reports
    # each step is not held to ~0.5 steps/s and its end is seen at once. Ray Train hands it
    # from the driver (this process) to each run's controller.
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")
    # ... and no preemption watcher (CLI_ENV again): Ray Train starts one actor per
    # worker-group start, ~2 s of CPU importing Ray Train, in every in-process fit here.
    from ray_mesh.raytrain.driver import PREEMPTION_WATCHER_ENV

    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    # Ray's workers at niceness 0, as `ray-mesh run`'s embedded Ray and the deploy scripts'
    # `ray start` run them (ray_mesh.core.priority): at Ray's 15, beside two busy processes
    # a worker gets ~1/30 of their CPU share and its start-up outlasts Ray Train's bound.
    from ray_mesh.core.priority import RAY_NICENESS_ENV

    os.environ.setdefault(RAY_NICENESS_ENV, "0")
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
