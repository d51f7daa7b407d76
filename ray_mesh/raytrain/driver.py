"""What the driver sets up around ``fit()``: Ray Train's run-state tracking, and a quiet
console for the embedded local Ray that ``ray-mesh run`` starts.

Run-state tracking (``RAY_TRAIN_ENABLE_STATE_TRACKING``, what ``ray-mesh status`` and the
dashboard read) is decided on the driver when ``fit()`` starts. It is only worth turning on
where the cluster serves Ray's state API (the dashboard, ``ray[default]``): without it, Ray's
``TrainStateActor`` and ``PlacementGroupCleaner`` poll an API that is not there and fill the
console with warnings and tracebacks. :func:`enable_state_tracking` asks once, bounded.

An embedded Ray shares the machine with any other Ray instance on it. Ray's own actors
(``PlacementGroupCleaner``, ``TrainStateActor``) find "their" cluster through
``RAY_ADDRESS`` or by scanning the host; with two instances the scan fails with a
traceback. :func:`embedded_worker_setup` (a ``worker_process_setup_hook``) gives every
process of the embedded instance its own address.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings

logger = logging.getLogger(__name__)

STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"
STATE_API_TIMEOUT_S = 3.0
# Ray Train 2.60 loggers that only speak about things an embedded one-machine Ray lacks:
# the autoscaler (there is none: its resource request times out on a busy machine) and the
# state API behind the placement-group cleaner (ray.shutdown removes every group anyway).
EMBEDDED_QUIET_LOGGERS = (
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",
    "ray.train.v2._internal.execution.controller.placement_group_cleaner",
)
# Ray Train settings for an embedded Ray (propagated by Ray Train to its controller and
# workers): no preemption watcher on one machine (nothing drains it; its actor start logs a
# core-worker error line about large constructor arguments).
EMBEDDED_ENV = {"RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0"}
# For every run of the CLI: a train function's print shows once. With Ray 2.60's print
# patch on, a print in a Ray Train worker is both logged and echoed: two lines.
CLI_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def state_api_available(timeout_s: float = STATE_API_TIMEOUT_S) -> bool:
    """True when the connected cluster answers a state API call within ``timeout_s``."""
    import ray

    if not ray.is_initialized():
        return False
    try:
        from ray.util.state import list_nodes

        list_nodes(limit=1, timeout=int(max(1, timeout_s)), raise_on_missing_output=False)
        return True
    except Exception as exc:  # noqa: BLE001 - no dashboard, another instance, a timeout
        logger.debug("ray_mesh: Ray's state API does not answer (%s: %s)",
                     type(exc).__name__, exc)
        return False


def enable_state_tracking() -> bool:
    """Turn on Ray Train's run-state tracking for this driver's next ``fit()`` where the
    state API exists; a value the user set wins. Returns whether tracking is on."""
    if STATE_TRACKING_ENV in os.environ:
        return os.environ[STATE_TRACKING_ENV] not in ("0", "", "false", "False")
    on = state_api_available()
    os.environ[STATE_TRACKING_ENV] = "1" if on else "0"
    if not on:
        logger.info("ray_mesh: Ray's state API does not answer here (no dashboard: install "
                    "ray[default]); run-state tracking, which `ray-mesh status` reads, is off.")
    return on


def embedded_worker_setup() -> None:
    """``worker_process_setup_hook`` of the embedded Ray: every process of it talks to it."""
    import ray

    with contextlib.suppress(Exception):  # a hook must not stop a worker from starting
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    # A filter, not setLevel: Ray Train's dictConfig resets the level of ray.train children.
    for name in EMBEDDED_QUIET_LOGGERS:
        logging.getLogger(name).addFilter(_errors_only)
    # Ray's own call inside Ray Train's controller (Ray 2.60), not something a user can fix.
    warnings.filterwarnings("ignore", message=r".*ExecutionOptions.exclude_resources.* is "
                            r"deprecated")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_report_lines() -> None:
    """On a worker: hide Ray Train's "Reporting training result ..." INFO line per report.

    Ray Train 2.60 logs it through ``logging.getLogger(__file__)`` in
    ``ray/train/v2/_internal/execution/context.py``: a logger named by a file path, outside
    ``ray.train``, so ``LoggingConfig(log_level=...)`` does not reach it. Checked on 2.60.
    """
    try:
        from ray.train.v2._internal.execution import context
    except ImportError:  # another Ray version: nothing to do
        return
    logger_ = logging.getLogger(context.__file__)
    if _above_info not in logger_.filters:
        logger_.addFilter(_above_info)


def _above_info(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO


__all__ = ["CLI_ENV", "EMBEDDED_ENV", "embedded_worker_setup", "enable_state_tracking",
           "quiet_report_lines", "state_api_available"]
