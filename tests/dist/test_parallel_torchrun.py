"""The parallel helpers' bad inputs on a real gloo group (torchrun, 4 ranks, no Ray).

``tests/_parallel_torchrun.py`` raises each bad input of the issue on every rank (a hidden
size not divisible by tp, more stages than layers, microbatches that do not divide the batch,
too few microbatches for 1F1B, CP on gloo, a dp mode the mesh cannot give), checks that data
is sharded by dp rank, and runs the hsdp example under torchrun. A hang would hit the timeout
here instead of passing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun import assert_checks, torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "_parallel_torchrun.py"
CHECKS = ["hsdp_example_under_torchrun", "tp_indivisible_hidden", "tp_plan_typo",
          "pp_more_stages_than_layers", "pp_interleaved_more_stages_than_layers",
          "pp_microbatches_vs_batch_size", "pp_microbatches_at_step",
          "pp_good_batch_after_bad_one", "pp_forward_only_and_deprecated_eval",
          "mesh_missing_dp_dim", "mesh_missing_pp_dim", "pp_1f1b_too_few_microbatches",
          "cp_on_gloo",
          "fsdp_mode_vs_mesh", "fsdp_bf16_mixed_precision", "ddp_mixed_precision",
          "data_by_dp_rank", "full_parameters_fsdp_tp_quiet"]



@pytest.mark.timeout(400)
def test_bad_inputs_raise_on_every_rank_without_hanging(tmp_path):
    proc = torchrun(SCRIPT, cwd=tmp_path, timeout=360)
    assert_checks(proc, CHECKS)
    assert "hsdp: step 3/3 loss" in proc.stdout
