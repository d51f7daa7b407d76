"""What a person sees: plain-text CLI help, and reported numbers turned into metrics (the
recorder's bookkeeping, no Ray instance)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from ray_mesh.cli.main import build_parser
from ray_mesh.observability import report as rep

COMMANDS = ([], ["run"], ["status"], ["plan"], ["doctor"])


@pytest.mark.parametrize("cmd", COMMANDS, ids=lambda c: " ".join(c) or "ray-mesh")
def test_help_is_plain_text(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*cmd, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: ray-mesh")
    for markup in ("``", ":class:", ":func:", ":meth:", ":mod:"):
        assert markup not in text, (cmd, markup, text)
    if cmd:  # every subcommand says what it does, not only its options
        assert len(text.split("\n\n")[1].strip()) > 40, text


def test_python_m_has_no_runpy_warning():
    proc = subprocess.run([sys.executable, "-m", "ray_mesh.cli.main", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, proc.stderr


def test_run_accepts_verbose_after_the_subcommand():
    args = build_parser().parse_args(["run", "job.yaml", "-v"])
    assert args.verbose is True
    assert build_parser().parse_args(["run", "job.yaml"]).verbose is False


def test_numbers_of_a_report_become_metric_values():
    assert rep.metric_name("val/loss-2") == "mesh_report_val_loss_2"
    import torch

    items = dict(rep.numeric_items({"loss": torch.tensor(0.5), "step": 3, "ok": True,
                                    "name": "x", "vec": torch.ones(2), "nan": float("nan")}))
    assert items == {"loss": 0.5, "step": 3.0}


def test_recorder_derives_step_time_from_the_step_key():
    rec = rep.ReportRecorder(None, flush_every_s=3600)
    for step in range(1, 11):
        rec.observe({"step": step * 2, "loss": 1.0 / step})
        time.sleep(0.01)
    values = rec.flush()
    # 9 intervals of 2 steps each in ~0.1 s: ~0.005 s per step, whatever the report spacing.
    assert 18 / 0.5 < values["steps_per_second"] < 18 / 0.08, values
    assert values["loss"] == pytest.approx(0.1)
    assert rec.summary()["reports"] == 10


def test_one_way_to_report_a_step():
    """ray_mesh.report (Ray Train's report plus the recorder) is the way: no meter object,
    no log_step, and Ray's own function is never replaced, not even while a run records."""
    import importlib

    import ray.train

    import ray_mesh

    assert "report" in ray_mesh.__all__ and ray_mesh.report is rep.report
    for gone in ("ray_mesh.observability.meter",):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    from ray_mesh.observability import progress

    assert not hasattr(progress, "log_step") and not hasattr(rep, "wrap_train_report")
    original = ray.train.report
    with rep.recording(rep.ReportRecorder()):
        assert ray.train.report is original


def test_report_outside_ray_train_names_the_torchrun_call():
    """No Ray Train run to report to: refused at once, naming report_progress."""
    from ray_mesh.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match=r"report_progress\(name, metrics"):
        rep.report({"step": 1})


def test_a_report_reaches_the_running_owners_recorder():
    """record() hands the dict to the running owner's recorder, and a recorder that fails
    does not fail the report."""
    from ray_mesh.observability import active

    class Owner:
        recorder = rep.ReportRecorder()

    owner = Owner()
    active.install(owner)
    try:
        rep.record({"step": 3, "loss": 0.5})
        assert owner.recorder.calls == 1 and owner.recorder.latest["loss"] == 0.5
        owner.recorder = None
        rep.record({"step": 4})  # no recorder: nothing to do
        owner.recorder = object()  # no observe(): logged at DEBUG, not raised
        rep.record({"step": 5})
    finally:
        active.clear(owner)
    rep.record({"step": 6})  # no owner at all


# ----------------------------------------------------------------------------- end of a run
def test_teardown_sweep_touches_no_deprecated_torch_attribute():
    """The sweep for live DeviceMeshes at shutdown ran ``isinstance`` over every object,
    which reads attributes of ``torch.distributed.reduce_op`` (a FutureWarning per rank at
    the end of every run)."""
    import warnings

    import torch.distributed as dist

    from ray_mesh.core import teardown

    assert dist.reduce_op is not None  # the deprecated object is alive in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        teardown._release_all()
    assert [str(w.message) for w in caught] == []


def test_summary_shows_no_metrics_address_for_a_node_without_a_metrics_port():
    from ray_mesh.cli.runner import node_metrics_url

    node = {"NodeID": "n1", "NodeManagerAddress": "10.0.0.5", "MetricsExportPort": -1}
    assert node_metrics_url([node], "n1") is None
    assert node_metrics_url([{**node, "MetricsExportPort": 0}], "n1") is None
    assert node_metrics_url([{**node, "MetricsExportPort": 8080}], "n1") == \
        "http://10.0.0.5:8080/metrics"
    assert node_metrics_url([{**node, "MetricsExportPort": 8080}], "other") is None


def test_wait_sampler_skips_a_group_that_has_no_name_yet():
    """A frame in distributed_c10d holding a process group that ``new_group`` is still
    building (the checkpointer's gloo group): its ``group_name`` raises RuntimeError
    'ProcessGroup name not set', which stopped the sampler for the rest of the run."""
    import torch.distributed as dist

    from ray_mesh.observability.waits import _C10D, WaitSampler

    unnamed = dist.ProcessGroup(dist.HashStore(), 0, 1)
    with pytest.raises(RuntimeError, match="name not set"):
        unnamed.group_name  # noqa: B018 - the attribute access is the point
    code = compile("import sys\nframe = sys._getframe()\n", f"/site/{_C10D}", "exec")
    scope = {"group": unnamed}
    exec(code, scope)  # a real frame of a file named like torch's distributed_c10d.py
    sampler = WaitSampler({}, interval_s=0.02, window_s=1.0)
    assert sampler.classify(scope["frame"]) is None


def test_console_checker_flags_the_shutdown_warning_of_a_ray_worker():
    """A Ray worker prints ray_mesh's WARNING records without their level: the README's
    main job showed this line on every rank and the checker let it through."""
    from console import problems

    line = ("\x1b[36m(RayTrainWorker pid=5296)\x1b[0m ray_mesh.shutdown_mesh(): the process "
            "group(s) of dp=dp_cp are still referenced (by a model wrapped with FSDP, a kept "
            "mesh.get_group(...), ...), so not freed: ... Drop those references (del model) "
            "before shutdown_mesh().\x1b[32m [repeated 3x across cluster]\x1b[0m")
    assert len(problems(line)) == 3


def test_console_checker_flags_the_cleaners_state_api_warning_but_not_its_once_line():
    """Ray Train's placement-group cleaner on a cluster without a dashboard: its WARNING
    (printed without the level) at every check is a problem; the one line the job's worker
    hook says instead (ray_mesh.raytrain.driver.CLEANER_ONCE) is not."""
    from console import problems

    from ray_mesh.raytrain.driver import CLEANER_ONCE

    raw = ("(PlacementGroupCleaner pid=27947) Failed to query Ray Train Controller actor "
           "state. State API may be temporarily unavailable. Continuing to monitor.")
    assert len(problems(raw)) == 1
    assert problems(f"(PlacementGroupCleaner pid=27947) {CLEANER_ONCE}") == []


def test_console_checker_flags_c_plus_plus_log_lines_of_torch_and_ray():
    """torch's bracketed C++ warnings (c10d's TCP store on a node without reverse DNS) and
    Ray's core-worker error lines (Ray Train's preemption watcher at every start) reached
    consoles the checker called clean; Ray's info lines are not problems."""
    from console import problems

    lines = ["(Coordinator pid=15292) [W1127 13:32:53.580302799 socket.cpp:207] [c10d] The "
             "hostname of the client socket cannot be retrieved. err=-3",
             "(TrainController pid=15740) [2026-11-27 13:33:28,424 E 15740 15781] "
             "core_worker.cc:2465: Actor with class name: 'PreemptionWatcher' and ID: '7ce5' "
             "has constructor arguments in the object store and max_restarts > 0."]
    assert [len(problems(x)) for x in lines] == [1, 1]
    assert problems("(raylet) [2026-11-27 13:33:28,424 I 15740 15781] node_manager.cc:1: "
                    "started") == []
