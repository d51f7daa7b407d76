"""The CLI's wait for the workers' last progress lines (ray_mesh/cli/console_tail.py)."""

from __future__ import annotations

import threading
import time

from ray_mesh.cli.console_tail import ProgressTail, final_steps


def batch(*lines: str) -> dict:
    return {"lines": list(lines), "pid": 1, "ip": "10.0.0.1", "is_err": True}


def test_the_highest_step_of_each_run_is_kept():
    tail = ProgressTail()
    tail.observe(batch("lab-g0: step 10/40 loss 4.5  1.2 steps/s", "llm: eval at step 40: x",
                       "\x1b[36mlab-g1: step 40/40 loss 2.4\x1b[0m", "lab-g0: step 30/40 loss 3"))
    tail.observe(batch("lab-g0: step 20/40 loss 3.1", "hsdp: step 7 loss 0.1"))
    assert tail.seen == {"lab-g0": 30.0, "lab-g1": 40.0, "hsdp": 7.0}
    assert tail.missing({"lab-g0": 40, "lab-g1": 40, "lab-g2": 40}) == ["lab-g0", "lab-g2"]


def test_wait_ends_when_the_line_arrives_and_is_bounded_otherwise():
    tail, said = ProgressTail(), []
    later = threading.Timer(0.2, tail.observe, [batch("run: step 5/5 loss 1")])
    later.start()
    t0 = time.monotonic()
    assert tail.wait({"run": 5}, timeout_s=10, say=said.append) == []
    assert time.monotonic() - t0 < 5 and not said
    t0 = time.monotonic()
    assert tail.wait({"run": 5, "other": 3}, timeout_s=0.3, say=said.append) == ["other"]
    assert 0.25 < time.monotonic() - t0 < 3
    assert said and "other (step 3)" in said[0] and "summary below" in said[0]


def test_only_runs_whose_last_report_reached_the_total_are_waited_for():
    runs = {"a": {"step": 40}, "b": {"step": 39}, "c": {"loss": 1.0}, "d": {"step": True},
            "e": {"step": 40.0}}
    assert final_steps(runs, 40) == {"a": 40.0, "e": 40.0}
    assert final_steps(runs, None) == {}


def test_a_progress_line_reads_back_as_its_name_and_step():
    from ray_mesh.observability.progress import parse_progress, progress_line

    line = progress_line("lab-g1", 40, 40, {"loss": 2.5}, {"steps_per_s": 1.5,
                                                          "tokens_per_s": 900.0})
    assert parse_progress(line) == ("lab-g1", 40.0)
    assert parse_progress(progress_line("hsdp", 7, None, {}, {})) == ("hsdp", 7.0)
    assert parse_progress("\x1b[36m" + line + "\x1b[0m") == ("lab-g1", 40.0)
    assert parse_progress("llm: eval at step 40: val loss 2.6") is None
    assert parse_progress("x: step 1.2.3 loss 1") is None


def test_a_driver_that_does_not_print_worker_output_waits_for_nothing():
    """ray.init(log_to_driver=False) (benchmarks/run.py): no worker line reaches this
    console, so waiting would cost the whole bound and then blame a busy node."""
    said: list[str] = []
    tail = ProgressTail(printing=lambda: False)
    t0 = time.monotonic()
    assert tail.wait({"run": 8.0}, timeout_s=5, say=said.append) == []
    assert time.monotonic() - t0 < 1 and said == []


def _result(tmp_path, summary: dict | None, metrics: dict):
    import json
    from types import SimpleNamespace

    from ray_mesh.observability.report import SUMMARY_FILE

    tmp_path.mkdir(parents=True, exist_ok=True)
    if summary is not None:
        (tmp_path / SUMMARY_FILE).write_text(json.dumps(summary))
    return SimpleNamespace(path=str(tmp_path), metrics=metrics, filesystem=None)


def test_a_run_resumed_at_its_last_step_waits_for_no_line(tmp_path):
    """A rerun of a finished run resumes at its last step and reports nothing: rank 0's
    summary and the checkpoint's metrics are the previous fit's. Waiting for that fit's last
    progress line cost the whole bound (15 s) and then blamed a busy node (seen,
    2026-11-29, `ray-mesh run` of examples/diloco.yaml twice on one storage path)."""
    from ray_mesh.observability.report import CLOCK_SKEW_S, ReportRecorder, last_report

    now = time.time()
    old = {"reports": 3, "saved_at": now - 120, "last": {"step": 6, "loss": 3.5}}
    metrics, fresh = last_report(_result(tmp_path, old, {"step": 6}), since=now)
    assert metrics["step"] == 6 and metrics["loss"] == 3.5 and not fresh
    assert final_steps({"d": metrics} if fresh else {}, 6) == {}
    # this fit's summary (clocks a little apart) and one without a time are this fit's
    skewed = {**old, "saved_at": now - CLOCK_SKEW_S / 2}
    for i, summary in enumerate((skewed, {"last": {"step": 6}}, None)):
        assert last_report(_result(tmp_path / str(i), summary, {"step": 6}),
                           since=now)[1]
    # the recorder's summary carries the time it was made
    assert abs(ReportRecorder().summary()["saved_at"] - time.time()) < 5


def test_a_rerun_with_nothing_to_train_does_not_show_the_earlier_fits_figures(tmp_path):
    """`ray-mesh run` of a finished job again (same name, same storage path): Ray Train
    resumes it at its last step, the train function has nothing to do and reports nothing.
    The summary said "finished: 20 steps in 36.0 s" and the earlier fit's throughput, as if
    this fit had trained; it says what happened and how to train afresh instead."""
    from types import SimpleNamespace

    from ray_mesh.cli.main import summary_lines
    from ray_mesh.cli.runner import RunOutcome

    result = SimpleNamespace(checkpoint=SimpleNamespace(path="/r/d/checkpoint_00000020"),
                             path="/r/d")
    earlier = {"step": 20, "loss": 1.766, "steps_per_s": 4.888}
    lines = summary_lines("d", RunOutcome(result, 26.4, None, True, earlier, fresh=False))
    assert lines[0] == ("ray-mesh: run 'd' finished in 26.4 s with nothing to train: it "
                        "resumed from the checkpoint of an earlier fit of the same name and "
                        "storage path, at step 20, and reported nothing. Another name (name:) "
                        "or --storage-path trains afresh."), lines
    assert not any("steps/s" in x or "1.766" in x for x in lines), lines
    assert lines[1:] == ["  checkpoint:  /r/d/checkpoint_00000020", "  results:     /r/d"]
    this_fit = summary_lines("d", RunOutcome(result, 26.4, None, True, earlier))
    # "at step 20", not "20 steps": a fit resumed mid-way trained fewer in its own time
    assert this_fit[0] == ("ray-mesh: run 'd' finished at step 20 in 26.4 s (start-up "
                           "included)")
