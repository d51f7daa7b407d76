"""The llm example under torchrun on 4 ranks (dp_shard 2 x tp 2, gloo), no Ray.

``numerics``: the Llama (GQA, rotary, SwiGLU; sequence parallel or not; tied embeddings with
activation checkpointing) matches a one-process run of the same model on the same batches
of standard-library text for 3 steps, losses and gathered parameters at rtol 1e-5; the
tp-peer batch guard raises on different batches. ``train``: the example's own loop learns:
the loss falls and validation bits per byte end below the text's unigram entropy.
The numerics and resume tests share one torchrun launch (a module fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torchrun import assert_checks, torchrun

SCRIPT = Path(__file__).resolve().parents[1] / "helpers" / "_llm_torchrun.py"
ROOT = Path(__file__).resolve().parents[2]



def _torchrun(mode: str, tmp_path: Path, *args: str) -> str:
    proc = torchrun(SCRIPT, mode, *args, cwd=tmp_path, timeout=300)
    assert_checks(proc, [])
    return proc.stdout


@pytest.fixture(scope="module")
def numerics_and_resume(tmp_path_factory):
    """One torchrun launch for the two default-tier tests below (``numerics_resume``: the
    numerics checks, then the resume checks on a mesh built again); each test asserts on
    its own part of the output."""
    tmp = tmp_path_factory.mktemp("llm_torchrun")
    return torchrun(SCRIPT, "numerics_resume", str(tmp / "ckpt"), cwd=tmp, timeout=420)


@pytest.mark.timeout(480)
def test_llm_fsdp_tp_matches_one_process(numerics_and_resume):
    proc = numerics_and_resume
    out = proc.stdout
    for name in ("llm_fsdp2_tp2_sp", "llm_fsdp2_tp2_no_sp", "llm_fsdp2_tp2_tied_ac",
                 "llm_ddp2_tp2", "tp_peer_guard"):
        assert f"PASS {name}" in out, (name, (out + proc.stderr)[-4000:])
    assert_checks(proc, [])


@pytest.mark.timeout(480)
def test_llm_torchrun_checkpoints_resume_exactly_from_the_newest(numerics_and_resume):
    proc = numerics_and_resume
    out = proc.stdout
    assert "PASS llm_resume_repeats_steps" in out and "PASS llm_resume_takes_newest" in out, \
        (out + proc.stderr)[-4000:]
    assert_checks(proc, [])


# Slow tier (~30 s of training): the LM benchmark and the DiLoCo benchmark train the same
# model further; FSDP/TP numerics and exact resume stay in the default tier.
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_llm_learns_below_unigram_entropy(tmp_path):
    out = _torchrun("train", tmp_path)
    line = next(x for x in out.splitlines() if x.startswith("SUMMARY "))
    summary = json.loads(line[len("SUMMARY "):])
    losses = [summary["losses"][k] for k in sorted(summary["losses"], key=int)]
    assert losses[-1] < 0.6 * losses[0], losses
    # Below the byte-frequency entropy: the model uses context, not just byte counts.
    assert summary["val_bpb"] < summary["unigram_bpb"] - 0.3, summary
    assert 4.0 < summary["unigram_bpb"] < 5.5, summary  # Python source, measured ~4.5
