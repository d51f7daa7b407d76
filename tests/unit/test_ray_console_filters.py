"""What the driver's worker setup hook hides from the user's console, and what it lets through.

Ray Train 2.60's controller logs a resource-request timeout to its autoscaling coordinator
with a whole traceback on a busy machine (seen in the diloco example's console with both
cores busy); Ray itself calls it safe to ignore when transient. The filter drops the first
two and shows later ones as one line; anything else from that logger passes unchanged."""

from __future__ import annotations

import logging
import sys

from ray_mesh.raytrain.driver import (
    AUTOSCALING_CLIENT_LOGGER,
    TransientRequestTimeouts,
    cluster_worker_setup,
)


class GetTimeoutError(Exception):
    """Named as Ray's (``ray.exceptions.GetTimeoutError``): the filter goes by the name, so
    that this hook imports nothing of Ray in every worker process."""


def _record(exc: BaseException | None, msg: str = "Failed to send resource request for "
            "train-1. If this only happens transiently ... safe to ignore this error.") \
        -> logging.LogRecord:
    info = None
    if exc is not None:
        try:
            raise exc
        except type(exc):
            info = sys.exc_info()
    return logging.LogRecord(AUTOSCALING_CLIENT_LOGGER, logging.WARNING, __file__, 1, msg,
                             (), info)


def test_transient_timeouts_are_hidden_and_persistent_ones_shown_in_one_line():
    f = TransientRequestTimeouts()
    assert f.filter(_record(GetTimeoutError("Get timed out"))) is False
    assert f.filter(_record(GetTimeoutError("Get timed out"))) is False
    third = _record(GetTimeoutError("Get timed out"))
    assert f.filter(third) is True
    assert third.exc_info is None  # no traceback
    text = logging.Formatter().format(third)
    assert "\n" not in text and "timed out 3 times" in text and "train-1" in text


def test_other_records_pass_unchanged():
    f = TransientRequestTimeouts()
    other = _record(RuntimeError("the coordinator died"))
    assert f.filter(other) is True and other.exc_info is not None
    plain = _record(None, "something else")
    assert f.filter(plain) is True and plain.getMessage() == "something else"


def test_the_hook_installs_it_once_on_rays_logger():
    logger = logging.getLogger(AUTOSCALING_CLIENT_LOGGER)
    cluster_worker_setup()
    cluster_worker_setup()
    assert sum(isinstance(f, TransientRequestTimeouts) for f in logger.filters) == 1
    # the names it relies on are the installed Ray's (checked on 2.60)
    import ray.exceptions
    from ray.train.v2._internal.execution.scaling_policy import autoscaling_coordinator_client

    assert autoscaling_coordinator_client.logger.name == AUTOSCALING_CLIENT_LOGGER
    assert ray.exceptions.GetTimeoutError.__name__ == GetTimeoutError.__name__
