"""DiLoCo on the replicate dim under torchrun (4 ranks, gloo, dp_replicate 2 x dp_shard 2).

``tests/helpers/_diloco_torchrun.py``: every=1 / outer lr 1 / momentum 0 equals sync HSDP;
one outer step equals the formula; replicas bitwise equal after every sync (none, bf16,
int8 with streaming fragments); a checkpoint between syncs (``ray_mesh.checkpointing.
replicas``, marker and manifest included) resumes bitwise; an overlapped sync lands one step
later and keeps that step's progress, and resumes bitwise; bad setups refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun import assert_checks, torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "_diloco_torchrun.py"
CHECKS = ["h1_lr1_m0_equals_sync_hsdp", "no_sync_before_h", "outer_step_equals_formula",
          "replicas_bitwise_equal_after_sync", "streaming_schedule_none", "replicas_equal_none",
          "replicas_equal_bf16", "replicas_equal_int8", "own_replica_found", "counters_restored",
          "model_restored",
          "outer_state_restored", "resume_bitwise",
          *(f"overlap_{name}_{mode}" for mode in ("none", "int8") for name in (
              "nothing_lands_at_send", "lands_one_step_later", "keeps_inflight_steps",
              "globals_bitwise_equal", "replicas_differ_by_inflight_steps", "flush_lands",
              "full_sync_equalizes")),
          "overlap_in_flight_at_save_step", "overlap_resume_bitwise",
          "refuses_hsdp_model", "refuses_size1_replicate_dim"]



@pytest.mark.timeout(400)
def test_diloco_checks_under_torchrun(tmp_path):
    proc = torchrun(SCRIPT, cwd=tmp_path, timeout=360)
    assert_checks(proc, CHECKS)
