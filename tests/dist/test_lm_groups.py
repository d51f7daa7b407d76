"""The LM of ``examples/llm.py`` as replica groups, without Ray: each group a torchrun world
(``tests/helpers/_lm_groups.py``) running the example's own replica-group loop, reading the
standard library's text by sample index, the run's ``Quorum`` served by this process.

An FSDP2 group of 2 ranks and an unsharded group of 1 train together; the FSDP group dies
at step 3 (a rank exits before the boundary), the other trains on alone, the dead group is
started again, heals from the live one and trains to the end. Every sample index that
entered an average was used exactly once (none twice, none skipped below the highest),
both groups built the same samples from their own reading of the files (one manifest),
and both end with the same parameters.

Two DiLoCo groups (FSDP2 of 2, unsharded) end with the same model. Their run rides on the
rejoin test's processes once its run is over (the helper's ``THEN``): the restarted FSDP group
and the unsharded one go on to a second quorum with fresh models, sparing a torchrun start;
the DiLoCo test starts its own groups when that run did not happen (the test run alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _lm_groups import CONFIG
from local_quorum import LocalQuorum
from ports import free_port

from ray_mesh.data.indexed import manifest
from ray_mesh.data.spec import DataSpec

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "_lm_groups.py"


def _launch(gid: int, layout: str, nproc: int, port: int, steps: int, out: Path,
            **env_extra: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env.update(env_extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["MANIFEST"] = manifest(DataSpec.from_dict(CONFIG["data"]))
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
         str(gid), layout, str(port), str(steps), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _wait(proc: subprocess.Popen, deadline: float, what: str) -> str:
    try:
        out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not end in time:\n{out[-4000:]}")
    return out


# The DiLoCo run (its quorum, its output folder) the rejoin test's groups ran after theirs.
_DILOCO: dict = {}
DILOCO_STEPS = 4
DILOCO_ENV = {"DILOCO_EVERY": "2", "DILOCO_COMPRESS": "int8"}


def _rows(out: Path, gid: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"g{gid}.jsonl").read_text().splitlines()]


@pytest.mark.timeout(420)
def test_two_lm_groups_use_every_sample_once_across_a_group_dying_and_rejoining(
        tmp_path, tmp_path_factory):
    steps = 40
    served = LocalQuorum(steps=steps, expected_groups=2, segment_samples=8)
    # then the DiLoCo test's run, on the restarted group 0 and on group 1 (see the docstring)
    diloco = LocalQuorum(steps=DILOCO_STEPS, expected_groups=2, segment_samples=8)
    diloco_dir = tmp_path_factory.mktemp("diloco")
    then = json.dumps({"port": diloco.port, "steps": DILOCO_STEPS, "out": str(diloco_dir),
                       "env": DILOCO_ENV})
    t0 = time.monotonic()
    deadline = t0 + 380
    # Group 1 (one rank) takes at least 1.5 s a step while alone: the restarted group finds
    # steps left (~50 s after the death).
    alone = _launch(1, "plain", 1, served.port, steps, tmp_path, ALONE_STEP_S="1.5",
                    WAIT_GROUPS="2", THEN=then)
    dying = _launch(0, "fsdp", 2, served.port, steps, tmp_path, DIE_AT_STEP="3")
    # group 0 started again: launched now, it joins the run once the dying world is gone
    gate = tmp_path / "rejoin"
    back = _launch(0, "fsdp", 2, served.port, steps, tmp_path, JOIN_AFTER=str(gate), THEN=then)
    try:
        out_dying = _wait(dying, deadline, "the dying group")
        assert dying.returncode != 0 and "FAILED group 0 rank 0 at step 3" in out_dying, \
            out_dying[-4000:]
    except BaseException:
        back.kill()
        raise
    gate.touch()
    outs = [_wait(back, deadline, "the restarted group"), _wait(alone, deadline, "group 1")]
    for proc, out in zip((back, alone), outs, strict=True):
        assert proc.returncode == 0, out[-6000:]
    wall = time.monotonic() - t0
    _DILOCO["out"] = diloco_dir

    events = [(e["kind"], e["group"]) for e in served.quorum.status()["events"]]
    assert ("left", 0) in events and ("healed", 0) in events, events
    rows = {g: _rows(tmp_path, g) for g in (0, 1)}
    assert rows[1][-1]["step"] == steps and rows[0][-1]["step"] == steps, rows
    assert len({r["attempt"] for r in rows[0]}) == 2, rows[0]  # before and after the death
    seen: dict[int, int] = {}
    for logged in rows.values():
        for row in logged:
            for start, n in row["ranges"]:
                for i in range(start, start + n):
                    seen[i] = seen.get(i, 0) + 1
    twice = sorted(i for i, c in seen.items() if c > 1)
    skipped = [i for i in range(max(seen) + 1) if i not in seen]
    assert not twice and not skipped, (twice, skipped)
    summaries = [json.loads((tmp_path / f"g{g}.json").read_text()) for g in (0, 1)]
    assert summaries[0]["data"] == summaries[1]["data"] != "", summaries  # one manifest
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()
    assert abs(summaries[0]["val_loss"] - summaries[1]["val_loss"]) < 1e-4, summaries
    losses = [v for _, v in sorted((int(k), v) for k, v in summaries[1]["losses"].items())]
    assert losses[-1] < losses[0] - 0.3, losses  # the LM learns from the samples it reads
    first = min(r["t"] for g in rows.values() for r in g)
    last = max(r["t"] for g in rows.values() for r in g)
    tokens = len(seen) * 32
    print(f"lm groups: {len(seen)} samples ({tokens} tokens) in {last - first:.1f} s of "
          f"training: {tokens / (last - first):.0f} tokens/s (wall {wall:.0f} s)")


@pytest.mark.timeout(300)
def test_two_diloco_lm_groups_end_with_the_same_model(tmp_path):
    """``config.diloco``: each group runs a round's inner steps on its own samples (2 per
    round here), the commit averages the pseudo-gradients, sent as int8 with error feedback
    (``compress``, honoured between groups as within a mesh); both end equal, every index
    of the rounds used once."""
    steps = DILOCO_STEPS
    if "out" in _DILOCO:  # run by the rejoin test's groups after theirs
        tmp_path = _DILOCO["out"]
    else:
        served = LocalQuorum(steps=steps, expected_groups=2, segment_samples=8)
        procs = [_launch(0, "fsdp", 2, served.port, steps, tmp_path, **DILOCO_ENV),
                 _launch(1, "plain", 1, served.port, steps, tmp_path, **DILOCO_ENV)]
        deadline = time.monotonic() + 240
        for proc, out in zip(procs, [_wait(p, deadline, f"group {g}") for g, p in
                                     enumerate(procs)], strict=True):
            assert proc.returncode == 0, out[-6000:]
    rows = {g: _rows(tmp_path, g) for g in (0, 1)}
    ids = sorted(i for logged in rows.values() for row in logged
                 for start, n in row["ranges"] for i in range(start, start + n))
    assert ids == list(range(2 * steps * 8)), ids
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-5), (x - y).abs().max()
