"""A replica group's ended attempt in its Ray Train controller's log: one line.

Ray Train's failure policy logs each decision with the error's whole text and a traceback
(~60 lines per closed laptop lid in the lab job's console), while the driver's console
already has the quorum's event line for the same end. ``AttemptWatch`` condenses the
policy's record in the group's controller; this drives Ray Train's real policy (no Ray
instance: the policy only decides and logs)."""

from __future__ import annotations

import logging

from ray.train import FailureConfig
from ray.train.v2._internal.execution.failure_handling.default import DefaultFailurePolicy
from ray.train.v2.api.exceptions import WorkerGroupError

from ray_mesh.private_apis import TRAIN_FAILURE_LOGGER
from ray_mesh.raytrain.attempt_watch import _one_line_failures


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _policy_logs(install: bool) -> list[logging.LogRecord]:
    log = logging.getLogger(TRAIN_FAILURE_LOGGER)
    keep, filters, level = _Keep(), list(log.filters), log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:
        if install:
            _one_line_failures()
            _one_line_failures()  # once per controller, however many attempts end
        error = WorkerGroupError(
            "[Rank 0 Error Snippet]:\nA worker health check failed.\nWorker info: Worker(\n"
            "  pid=15998,\n)\nThe actor died because its node has died.",
            {0: RuntimeError("A worker health check failed.")})
        DefaultFailurePolicy(FailureConfig(max_failures=20)).make_decision(
            training_failed_error=error)
    finally:
        log.removeHandler(keep)
        log.filters[:] = filters
        log.setLevel(level)
    return keep.records


def test_the_failure_policys_record_of_an_ended_attempt_is_one_line():
    raw = _policy_logs(install=False)
    assert len(raw) == 1 and len(raw[0].getMessage().splitlines()) > 5 and raw[0].exc_info
    (record,) = _policy_logs(install=True)
    assert record.getMessage() == ("[FailurePolicy] RETRY (worker group, failure 1 of at most "
                                   "20): A worker health check failed.")
    assert record.exc_info is None
    assert sum(type(f).__name__ == "_OneLine"
               for f in logging.getLogger(TRAIN_FAILURE_LOGGER).filters) == 0  # restored
