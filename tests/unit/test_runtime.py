"""One "running under Ray Train?" test (ray_mesh.core.runtime), Ray-free when Ray is absent.

The positive case needs a Ray Train worker: the tests/ray runs check it through what it
gates (progress reports reach ``Result.metrics``, metrics tags carry the run name).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ray_mesh.core import runtime


def test_answers_no_without_importing_ray():
    code = ("import sys; from ray_mesh.core import runtime; "
            "assert runtime.train_context() is None and not runtime.in_ray_train(); "
            "from ray_mesh.observability import progress, report; "
            "progress.progress_line('x', 1, 2, {'loss': 1.0}, {}); "
            "assert 'ray' not in sys.modules, 'the check imported ray'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_no_when_ray_is_imported_but_not_a_train_worker(monkeypatch):
    # Ray may or may not be initialized in this process (the suite's shared Ray instance
    # lives on between tests): either way a driver is not a Train worker.
    import ray  # noqa: F401

    assert runtime.train_context() is None and not runtime.in_ray_train()
    monkeypatch.setenv(runtime.TORCHRUN_ENV, "some-run")
    assert not runtime.in_ray_train()


def test_checkpointer_outside_ray_train_names_the_fix():
    from ray_mesh.checkpointing import Checkpointer, CheckpointError

    with pytest.raises(CheckpointError, match=r"inside a Ray Train train function.*save\(\.\.\.\)"):
        Checkpointer(torch.nn.Linear(2, 2))


def test_one_definition():
    from ray_mesh.checkpointing import guards
    from ray_mesh.observability import export

    assert export.train_context is runtime.train_context
    with pytest.raises(guards.CheckpointError):
        guards.train_context()


def test_report_progress_prints_the_progress_line_outside_ray_train(capsys):
    """The examples' one train function under torchrun (here: no process group, no Ray
    Train): the line ray_mesh's recorder shows under Ray Train, printed by the process."""
    from ray_mesh.observability.report import report_due, report_progress

    report_progress("hsdp", {"step": 10, "loss": 0.40531}, 40)
    assert capsys.readouterr().out == "hsdp: step 10/40 loss 0.4053\n"
    report_progress("llm", {"step": 10, "loss": 0.4, "tokens_per_s": 1234.5}, 40)
    assert capsys.readouterr().out == "llm: step 10/40 loss 0.4000  1234 tokens/s\n"
    # a rate of 0 (the loop had no interval yet) is not shown, as under Ray Train
    report_progress("llm", {"step": 1, "loss": 0.4, "tokens_per_s": 0.0}, 40)
    assert capsys.readouterr().out == "llm: step 1/40 loss 0.4000\n"
    assert [s for s in range(10) if report_due(s, 10, 4)] == [0, 3, 7, 9]
