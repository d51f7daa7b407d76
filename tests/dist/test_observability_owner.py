"""The worker's observability has one owner: start, stop and restart in one process
(real gloo ranks under torchrun, a real hang watch on the rendezvous store)."""

from __future__ import annotations

from pathlib import Path

from torchrun import assert_checks, torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "_owner_torchrun.py"


def test_observability_starts_stops_and_restarts_in_one_process():
    proc = torchrun(SCRIPT, nproc=2, timeout=180)
    assert_checks(proc, ["start_stop_restart", "a_new_start_stops_the_owner_left_running",
                         "watch_mesh_under_torchrun"])
