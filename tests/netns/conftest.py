"""Virtual clusters shared by several netns test modules.

Starting a NetnsCluster with Ray costs ~15 s on a 2-core machine. Modules whose tests need the
same kind of cluster, and leave it as they found it, share one:

* ``dashboard_cluster``: 2 nodes x ``slot: 2`` with the head's dashboard (and ``uneq`` 3 vs 1
  for the planner's unequal-placement check) and a bucket key (:data:`BUCKET_CREDENTIALS`) in
  every node's environment, for tests/netns/test_exposure.py (first, before any job ran on
  it: it lists the listeners), tests/netns/test_slow_netns.py (which shapes the links for
  its runs and unshapes them after), tests/netns/test_checkpoint_netns.py's default tier
  (which serves its bucket with that key on the head while it runs) and
  tests/netns/test_multinode.py (last: its link-cut test breaks node 1 for good);
* ``plain_cluster``: 2 nodes x ``slot: 2``, no dashboard (its idle traffic would blur the
  DiLoCo test's byte counts), links shaped by each test itself, for
  tests/netns/test_diloco_netns.py, tests/netns/test_mesh_auto.py and
  tests/netns/test_private_files.py (last: it only reads and writes node-local files).

Both run on real WireGuard (the harness's default ``tunnel``).

The modules that use one cluster are run one after another, in the order ``ORDER`` gives
(collection moves them up to the place of the first of them), and the cluster is stopped
right after its last test, not at the end of the session.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from moto_s3 import new_credentials

from harness.netns import NetnsCluster, netns_unavailable_reason

# The key of the checkpoint test's bucket server: in every node's environment before Ray
# starts, as each real machine exports it.
BUCKET_CREDENTIALS = new_credentials()

# Fixture name -> NetnsCluster arguments.
SHARED = {
    # A busy machine can push `ray start` past Ray's fixed 30 s raylet wait: more tries.
    # Ray's metrics exported every 2 s, not 10: the slow-link verdict that
    # tests/netns/test_slow_netns.py waits for is read from them (~8 s sooner).
    "dashboard_cluster": dict(resources=[{"slot": 2, "uneq": 3}, {"slot": 2, "uneq": 1}],
                              dashboard=True, start_attempts=4, ray_start_timeout_s=180,
                              env={**BUCKET_CREDENTIALS,
                                   "RAY_metrics_report_interval_ms": "2000"}),
    "plain_cluster": dict(resources=[{"slot": 2}, {"slot": 2}]),
}
# The order of the modules that share a cluster (others: after these, in file order).
ORDER = {"dashboard_cluster": ["test_exposure.py", "test_slow_netns.py",
                               "test_checkpoint_netns.py", "test_multinode.py"],
         "plain_cluster": ["test_diloco_netns.py", "test_mesh_auto.py",
                           "test_private_files.py"]}
_live: dict[str, NetnsCluster] = {}


@pytest.fixture(scope="session", autouse=True)
def _no_preemption_watcher():
    """The namespace tests' Python drivers (and every node's Ray, which copies this
    process's environment) start no Ray Train preemption watcher, as ``ray-mesh run`` and
    the shared local Ray of tests/ray (tests/conftest.py) do: one actor less per
    worker-group start, ~2 s of a busy machine each."""
    from ray_mesh.raytrain.driver import PREEMPTION_WATCHER_ENV

    had = os.environ.get(PREEMPTION_WATCHER_ENV)
    os.environ.setdefault(PREEMPTION_WATCHER_ENV, "0")
    yield
    if had is None:
        os.environ.pop(PREEMPTION_WATCHER_ENV, None)


def _start(name: str) -> NetnsCluster:
    if reason := netns_unavailable_reason():
        pytest.skip(f"virtual Tailscale cluster unavailable: {reason}")
    cluster = NetnsCluster(**SHARED[name])
    cluster.__enter__()  # stops what it built if the start fails
    _live[name] = cluster
    return cluster


@pytest.fixture(scope="session")
def dashboard_cluster():
    yield _start("dashboard_cluster")
    _stop("dashboard_cluster")


@pytest.fixture(scope="session")
def plain_cluster():
    yield _start("plain_cluster")
    _stop("plain_cluster")


def _stop(name: str) -> None:
    cluster = _live.pop(name, None)
    if cluster is not None:
        cluster.stop()


def _users(item: pytest.Item) -> list[str]:
    return [name for name in SHARED if name in item.fixturenames]


def _module(item: pytest.Item):
    return getattr(item, "module", None)


def pytest_collection_modifyitems(config, items):
    """Run the modules that share a cluster back to back (each module's tests kept whole and
    in order), at the place of the first of them."""
    for name in SHARED:
        modules = list(dict.fromkeys(_module(item) for item in items if name in _users(item)))
        if len(modules) < 2:
            continue
        order = ORDER.get(name, [])
        modules.sort(key=lambda m: order.index(Path(m.__file__).name)
                     if Path(m.__file__).name in order else len(order))
        group = [item for m in modules for item in items if _module(item) is m]
        first = next(i for i, item in enumerate(items) if _module(item) in modules)
        before = items[:first]
        after = [item for item in items[first:] if _module(item) not in modules]
        items[:] = before + group + after


@pytest.hookimpl(trylast=True)  # after pytest's own: the test's fixtures are finalized
def pytest_runtest_teardown(item, nextitem):
    """Stop a shared cluster as soon as no later test of the run needs it."""
    for name in _users(item):
        if name not in _live:
            continue
        later = item.session.items[item.session.items.index(item) + 1:]
        if not any(name in _users(other) for other in later):
            _stop(name)
