"""Train function for the Ray checkpoint tests and benchmarks/recovery.py (loaded by path
and shipped by value).

HSDP toy model, deterministic data (a batch depends only on the step and the dp rank), a
Checkpointer, and two test hooks driven by the config: rank 1 SIGKILLs itself at a chosen
step on the first attempt only (a marker file says the kill happened), and rank 0 appends
what it did to a log file, so the test can read the step history across attempts.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import ray_mesh
from ray_mesh.checkpointing import Checkpointer, full_model_state
from ray_mesh.parallel import dp_rank as dp_rank_of


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch: the same for a step and a data-parallel rank (or replica) in
    every run, so resumed runs can be compared bitwise."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    x = torch.randn(8, 12, generator=g)
    return x, x.sin()[:, :6]


def log_line(config: dict, line: str) -> None:
    """One timestamped line appended to the test's log file (``config["log"]``)."""
    with open(config["log"], "a") as f:
        f.write(f"{line} @{time.time():.2f}\n")


# The DiLoCo train function's (tests/helpers/_diloco_train.py) and its reference's.
DILOCO_DROPOUT = 0.2


def make_model(dropout: float) -> nn.Module:
    """The checkpoint tests' MLP, seeded: the train functions and their Ray-free references
    (tests/helpers/_ckpt_reference.py) build the same one. ``dropout``: random draws in every
    step, so a resume is bitwise only when the random state is restored with the checkpoint
    (0: none)."""
    torch.manual_seed(0)
    drop = [nn.Dropout(dropout)] if dropout else []
    return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), *drop, nn.Linear(16, 6))


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    rank = torch.distributed.get_rank()
    model = make_model(config.get("dropout", 0.0))
    fully_shard(model, mesh=mesh["dp_replicate", "dp_shard"])
    optim = torch.optim.AdamW(model.parameters(), lr=0.02)
    ckpt = Checkpointer(model, optim, every=config["every"],
                        async_save=config.get("async_save", False),
                        upload=config.get("upload"))
    start = ckpt.restore()
    assert start.data_position.get("next_step", 0) == start.step
    if rank == 0:
        spec = ray_mesh.get_state().spec
        log_line(config, f"start {start.step} {Path(start.path).name if start.path else '-'} "
                     f"mesh={spec.dp_replicate}x{spec.dp_shard}")
    # the flattened dp dim the mesh kept (slicing it from the root mesh is deprecated:
    # torch warns on every rank)
    dp_rank = dp_rank_of(mesh)
    for step in range(start.step, config["steps"]):
        x, y = batch(step, dp_rank)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        done = step + 1
        time.sleep(config.get("step_sleep", 0))  # elastic test: time to lose a node mid-run
        kill = config.get("kill_at")
        if kill and done == kill and rank == 1 and not os.path.exists(config["kill_marker"]):
            Path(config["kill_marker"]).write_text("killed")
            if config.get("corrupt"):  # damage a shard of a checkpoint Ray has registered
                (target,) = Path("/").glob(config["corrupt"].lstrip("/"))
                shard = sorted(target.glob("*.distcp"))[0]
                data = bytearray(shard.read_bytes())
                if config.get("corrupt_mode") == "flip":  # same length, one bit changed
                    data[len(data) // 2] ^= 0x01
                else:
                    data = data[:16]
                shard.write_bytes(bytes(data))
            os.kill(os.getpid(), signal.SIGKILL)
        before = ckpt.last_reported_checkpoint
        ckpt.report(done, {"loss": loss.item()}, data_position={"next_step": done})
        if rank == 0:
            after = ckpt.last_reported_checkpoint
            log_line(config, f"step {done}" + (f" ckpt {after}" if after != before else ""))
    ckpt.close()
    full = full_model_state(model)
    if rank == 0:
        torch.save(full, config["final"])


# The log above, read back by the tests: one list of lines per attempt ('start' begins one).
def attempts(log: Path) -> list[list[str]]:
    out: list[list[str]] = []
    for line in log.read_text().splitlines():
        if line.startswith("start"):
            out.append([])
        out[-1].append(line)
    return out


def steps(lines: list[str]) -> list[int]:
    """Steps reported, in order (lines look like 'step 7 ckpt 6 @<time>')."""
    return [int(x.split()[1]) for x in lines if x.startswith("step")]
