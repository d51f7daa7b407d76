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
    rec = rep.ReportRecorder(export=False, flush_every_s=3600)
    for step in range(1, 11):
        rec.observe({"step": step * 2, "loss": 1.0 / step})
        time.sleep(0.01)
    values = rec.flush()
    # 9 intervals of 2 steps each in ~0.1 s: ~0.005 s per step, whatever the report spacing.
    assert 18 / 0.5 < values["steps_per_second"] < 18 / 0.08, values
    assert values["loss"] == pytest.approx(0.1)
    assert rec.summary()["reports"] == 10


def test_report_outside_ray_train_records_only(monkeypatch):
    monkeypatch.setattr(rep, "_recorder", rep.ReportRecorder(export=False))
    assert rep.report({"step": 1, "loss": 2.0}, every=1) is False
    assert rep.recorder().latest == {"step": 1, "loss": 2.0}
    with pytest.raises(ValueError, match="every"):
        rep.report({"step": 2}, every=0)
