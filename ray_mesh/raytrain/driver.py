"""What the driver sets up around ``fit()``: Ray Train's run-state tracking, and a quiet
console for the embedded local Ray that ``ray-mesh run`` starts.

Run-state tracking (``RAY_TRAIN_ENABLE_STATE_TRACKING``, what ``ray-mesh status`` and the
dashboard read) is decided on the driver when ``fit()`` starts. It is only worth turning on
where the cluster serves Ray's state API (the dashboard, ``ray[default]``): without it, Ray's
``TrainStateActor`` and ``PlacementGroupCleaner`` poll an API that is not there and fill the
console with warnings and tracebacks. :func:`enable_state_tracking` asks once, bounded, and
keeps tracking on where the API is only slow (state_api.py tells slow from absent;
upstream: ray-train-state-tracking-needs-state-api).

An embedded Ray shares the machine with any other Ray instance on it. Ray's own actors
(``PlacementGroupCleaner``, ``TrainStateActor``) find "their" cluster through
``RAY_ADDRESS`` or by scanning the host; with two instances the scan fails with a
traceback. :func:`embedded_worker_setup` (a ``worker_process_setup_hook``) gives every
process of the embedded instance its own address (upstream: ray-state-api-multiple-instances).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings

from ray_mesh.raytrain import state_api

logger = logging.getLogger(__name__)

STATE_TRACKING_ENV = "RAY_TRAIN_ENABLE_STATE_TRACKING"
STATE_API_TIMEOUT_S = state_api.PROBE_TIMEOUT_S
# Ray Train loggers that only speak about things an embedded one-machine Ray lacks: the
# autoscaler (there is none: its resource request times out on a busy machine) and the
# state API behind the placement-group cleaner (ray.shutdown removes every group anyway).
# (upstream: ray-train-embedded-logger-chatter)
EMBEDDED_QUIET_LOGGERS = (
    "ray.train.v2._internal.execution.scaling_policy.autoscaling_coordinator_client",
    "ray.train.v2._internal.execution.controller.placement_group_cleaner",
)
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
# For every run of the CLI (a value the user set wins; Ray Train propagates them to its
# controller and workers, on a cluster too):
# * a train function's print shows once. With Ray Train's print patch on, a print in a Ray
#   Train worker is both logged and echoed: two lines (upstream: ray-train-print-patch-twice);
# * the controller looks at its workers every 0.2 s, not 2 s. A worker's report waits until
#   the controller has taken the previous one (a queue of one), so at Ray's default a run
#   that reports every step makes at most ~0.5 steps/s, and a finished or failed run is seen
#   up to 2 s late (docs/monitoring.md: 10 reports 18.2 s at 2 s, 1.7 s at 0.2 s). Each look
#   is one small call per worker (upstream: ray-train-report-queue-of-one);
# * no preemption watcher (upstream: ray-train-preemption-watcher). Ray Train starts one
#   actor per worker-group start (~2 s of CPU importing Ray Train), whose start logs a
#   core-worker error line ("has constructor arguments in the object store and
#   max_restarts > 0") on every console; what it does, a log line and a flag a train
#   function may read when a node is drained, nothing in ray_mesh reads: a node that goes
#   is a restart of the run (FailureConfig) or a replica group leaving.
#   RAY_TRAIN_ENABLE_PREEMPTION_WATCHER=1 brings it back.
CLI_ENV = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
           PREEMPTION_WATCHER_ENV: "0"}


def state_api_available(timeout_s: float = STATE_API_TIMEOUT_S) -> bool:
    """True when the connected cluster answers a state API call within ``timeout_s``."""
    import ray

    if not ray.is_initialized():
        return False
    return state_api.probe(timeout_s=timeout_s).verdict is state_api.Verdict.ANSWERS


def enable_state_tracking() -> bool:
    """Turn on Ray Train's run-state tracking for this driver's next ``fit()`` where the
    state API exists; a value the user set wins. Returns whether tracking is on.

    Decided on "exists", not on "answered within 3 s": the flag is read once when ``fit()``
    builds its callbacks, so a slow answer (a busy head) keeps tracking on and a background
    thread keeps asking, bounded (see state_api.py)."""
    import ray

    if STATE_TRACKING_ENV in os.environ:
        return os.environ[STATE_TRACKING_ENV] not in ("0", "", "false", "False")
    if not ray.is_initialized():
        return False
    first = state_api.probe(timeout_s=STATE_API_TIMEOUT_S)
    on = first.verdict.tracking
    os.environ[STATE_TRACKING_ENV] = "1" if on else "0"
    if first.verdict is not state_api.Verdict.ANSWERS:
        logger.info("%s", state_api.message(first, STATE_API_TIMEOUT_S))
    if first.verdict is state_api.Verdict.SLOW:
        state_api.retry_in_background(first.url)
    return on


WARM_TIMEOUT_S = 60.0  # the autoscaling coordinator's start on a busy driver node
# After the warm-up, how long the nodes' ray_mesh import probes may still take (a probe
# pending past it is left to the run's own bounded start-up).
NODE_PROBE_WAIT_S = 10.0


def warm_controller_actors(interface: str | None = None) -> None:
    """Before ``fit()``: start the actor Ray Train's controller asks for resources
    (``private_apis.start_autoscaling_coordinator``: made on first use, its start on a busy
    machine outlasts the controller's 5 s wait and prints a traceback), and meanwhile ask
    every node whether its workers can import ray_mesh (``node_install``: a node that
    cannot is refused here, in a second, instead of a minute of restarts) and, given the
    run's ``interface`` setting, whether each node has the interface the workers will pick
    (a node registered under its LAN address among tailnet nodes is refused here too).
    Bounded; a coordinator that does not answer in time is said once, in one line
    (upstream: ray-train-autoscaler-start-deadline)."""
    import ray

    from ray_mesh.private_apis import start_autoscaling_coordinator
    from ray_mesh.raytrain.node_install import NodeImportProbe

    if not ray.is_initialized():
        return
    probe = NodeImportProbe()
    # This node's answer first: the coordinator is a detached actor made in this job's
    # environment, and one made where ray_mesh does not import never starts, while every
    # later run on the cluster finds it by name and waits on it (~100 s of Ray Train's
    # GetTimeoutError tracebacks per run, seen after a refused run).
    probe.check(timeout_s=WARM_TIMEOUT_S, node_id=ray.get_runtime_context().get_node_id())
    ready = start_autoscaling_coordinator()
    deadline = time.monotonic() + WARM_TIMEOUT_S
    while ready is not None and time.monotonic() < deadline:
        probe.check()
        if ray.wait([ready], timeout=min(1.0, max(0.0, deadline - time.monotonic())))[0]:
            ready = None
    if ready is not None:
        logger.info("Ray's autoscaling coordinator did not start within %.0f s (a busy head "
                    "node?): Ray Train may log a resource-request timeout; it retries on "
                    "its own", WARM_TIMEOUT_S)
    probe.check(timeout_s=NODE_PROBE_WAIT_S)
    if interface is not None:
        probe.check_network(interface)


def cluster_worker_setup() -> None:
    """``worker_process_setup_hook`` of a job (``ray-mesh run``, the driver example): every
    process of the job talks to the cluster it belongs to, and what Ray says to itself is
    kept out of the user's console.

    ``RAY_ADDRESS``: Ray Train's own state-API calls (its placement-group cleaner and run
    state actor, ``ray.util.state.get_actor`` without an address) auto-detect the cluster
    and raise "Found multiple active Ray instances" (a traceback per check, on the driver's
    console) on a machine that runs a second Ray instance
    (upstream: ray-state-api-multiple-instances)."""
    import ray

    with contextlib.suppress(Exception):  # a hook must not stop a worker from starting
        os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
    # Ray's own call inside Ray Train's controller when a job has datasets, not something a
    # user can fix; printed on the driver's console by log_to_driver
    # (upstream: ray-data-exclude-resources-warning).
    warnings.filterwarnings("ignore", message=r".*ExecutionOptions.exclude_resources.* is "
                            r"deprecated")
    quiet_cleaner()


def quiet_cleaner() -> None:
    """Ray Train's placement-group cleaner says "no state API" once (see below), not at
    every check; installed once per process."""
    cleaner = logging.getLogger(CLEANER_LOGGER)
    if not any(isinstance(f, SaidOnce) for f in cleaner.filters):
        cleaner.addFilter(SaidOnce(CLEANER_NO_STATE_API, CLEANER_ONCE))


# Ray Train starts a placement-group cleaner for every run; it asks Ray's state API (the
# dashboard, ray[default] on the head) whether the controller lives, and on a cluster
# without one logs this WARNING at every check: ~45 lines in a short run. Said once instead
# (upstream: ray-train-cleaner-no-state-api).
CLEANER_LOGGER = "ray.train.v2._internal.execution.controller.placement_group_cleaner"
CLEANER_NO_STATE_API = "Failed to query Ray Train Controller actor state"
CLEANER_ONCE = ("Ray Train's placement-group cleaner cannot reach Ray's state API (no "
                "dashboard on this cluster: ray[default] on the head serves it); it keeps "
                "watching and removes the run's placement group when the run ends. Said once.")


class SaidOnce(logging.Filter):
    """Lets the first record whose message starts with ``prefix`` through as ``once`` (one
    line, no traceback) and drops the later ones; every other record passes unchanged.
    Never raises and never blocks: a logging filter runs inside whatever Ray was doing."""

    def __init__(self, prefix: str, once: str) -> None:
        super().__init__()
        self.prefix, self.once, self.seen = prefix, once, 0

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if not str(record.msg).startswith(self.prefix):
                return True
            self.seen += 1
            if self.seen > 1:
                return False
            record.msg, record.args = self.once, ()
            record.exc_info, record.exc_text = None, None
            return True
        except Exception:  # noqa: BLE001 - a filter must never break the caller's logging
            return True


def embedded_worker_setup() -> None:
    """``worker_process_setup_hook`` of the embedded Ray: the cluster job's hook, and Ray's
    own INFO chatter hidden (the user started no cluster)."""
    # A filter, not setLevel: Ray Train's dictConfig resets the level of ray.train children.
    for name in EMBEDDED_QUIET_LOGGERS:
        logging.getLogger(name).addFilter(_errors_only)
    cluster_worker_setup()


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_report_lines() -> None:
    """On a worker: hide Ray Train's "Reporting training result ..." INFO line per report.

    Ray Train logs it through ``logging.getLogger(__file__)`` in
    ``ray/train/v2/_internal/execution/context.py``: a logger named by a file path, outside
    ``ray.train``, so ``LoggingConfig(log_level=...)`` does not reach it
    (upstream: ray-train-report-log-line).
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
