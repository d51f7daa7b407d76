"""What the job's worker setup hook does to Ray's own console lines (ray_mesh.raytrain.driver).

On a cluster without a dashboard, Ray Train 2.60's placement-group cleaner logs "Failed to
query Ray Train Controller actor state" at every check (~45 WARNING lines in a short run).
The hook says it once, as one line that says why, and lets everything else through; the
filter never raises, whatever the record holds."""

from __future__ import annotations

import logging

from ray_mesh.raytrain.driver import CLEANER_LOGGER, SaidOnce, quiet_cleaner

NOISE = ("Failed to query Ray Train Controller actor state. State API may be temporarily "
         "unavailable. Continuing to monitor.")


def _record(msg: object, args: tuple = ()) -> logging.LogRecord:
    return logging.LogRecord(CLEANER_LOGGER, logging.WARNING, __file__, 1, msg, args, None)


def test_the_cleaners_state_api_warning_is_said_once_in_one_line():
    f = SaidOnce("Failed to query Ray Train Controller actor state", "said once: no dashboard")
    first = _record(NOISE)
    assert f.filter(first) is True and first.getMessage() == "said once: no dashboard"
    assert [f.filter(_record(NOISE)) for _ in range(44)] == [False] * 44
    other = _record("Failed to query placement group table: %s", ("boom",))
    assert f.filter(other) is True and other.getMessage() == "Failed to query placement group "\
        "table: boom"


def test_the_filter_never_raises():
    class Hostile:
        def __str__(self) -> str:
            raise RuntimeError("a message that cannot be printed")

    assert SaidOnce("x", "y").filter(_record(Hostile())) is True


def test_the_hook_installs_it_once_on_rays_logger():
    # (cluster_worker_setup calls it; that hook also asks Ray's runtime context, which
    # would connect this unit-test process to a Ray)
    logger = logging.getLogger(CLEANER_LOGGER)
    quiet_cleaner()
    quiet_cleaner()
    assert sum(isinstance(f, SaidOnce) for f in logger.filters) == 1
    # the logger and message it relies on are the installed Ray's (checked on 2.60)
    import inspect

    from ray.train.v2._internal.execution.controller import placement_group_cleaner as pgc

    assert pgc.logger.name == CLEANER_LOGGER
    assert "Failed to query Ray Train Controller actor state" in inspect.getsource(pgc)
