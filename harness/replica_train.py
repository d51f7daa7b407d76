"""Train function of the replica-group tests and benchmark (loaded by path, shipped by value).

A small MLP regression, FSDP inside each group (``dp_shard`` over the group's workers), and
data by sample index: sample ``i`` is the same tensor in every run, so runs with and without
failures see the same samples. Test hooks driven by the config:

* ``kill``: ``{"group": g, "rank": r, "at_step": s, "marker": path}``: that rank SIGKILLs
  itself when its group reaches step ``s`` on a commit, once (the marker says it happened);
  ``"group": "all"`` kills rank ``r`` of every group (the fallback test);
* ``log_dir``: each group's rank 0 appends one JSON line per committed step (the samples its
  contribution was computed on, the groups present, the loss, the time) to ``g<i>.jsonl``;
* ``step_s``: a floor on a step's wall time, so that a kill lands mid-run on a fast machine;
* ``work``: extra compute per sample (that many 128x128 matmuls), so that a step's time is
  CPU work that a slowed box really takes longer for;
* ``pin_cpu``: ``{group: cpu}``: that group's training thread (and torch's one intra-op
  thread) runs on that core only (the unequal-boxes test loads one core with another
  process).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import ray_mesh
from harness import replica_check
from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.parallel import parallelize
from ray_mesh.raytrain.replica_groups import CONFIG_KEY, replica_group

DIM = 16
EVAL = 256


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: the same in every run."""
    x = torch.randn(DIM, generator=torch.Generator().manual_seed(10_000 + i))
    return x, (x[:DIM // 2] * 1.5).tanh()


def samples(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(sample(i) for i in ids), strict=True)
    return torch.stack(xs), torch.stack(ys)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, DIM // 2))


def eval_loss(model: nn.Module) -> float:
    """Loss on a fixed held-out set (sample ids past any run's reach)."""
    x, y = samples(list(range(10**7, 10**7 + EVAL)))
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def burn(n_samples: int, work: int) -> None:
    """``work`` matmuls per sample: real CPU time, proportional to the samples."""
    a = torch.ones(128, 128)
    for _ in range(n_samples * work):
        a = torch.mm(a, a).clamp_(-1, 1)


def _maybe_kill(config: dict, gid: int, step: int) -> None:
    kill = config.get("kill")
    if not kill or step != kill["at_step"] or dist.get_rank() != kill.get("rank", 0):
        return
    if kill["group"] not in ("all", gid):
        return
    marker = Path(f"{kill['marker']}.g{gid}")
    if marker.exists():
        return
    marker.write_text(str(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def train_loop(config: dict) -> None:
    mesh = ray_mesh.get_mesh()
    gid = config[CONFIG_KEY]["group_id"]
    pin = (config.get("pin_cpu") or {}).get(str(gid))
    if pin is not None:
        torch.set_num_threads(1)
        os.sched_setaffinity(0, {int(pin)})  # 0: this (the training) thread
    model = parallelize(make_model(), mesh)
    diloco = DiLoCoConfig(**config["diloco"]) if config.get("diloco") else None
    optim = (torch.optim.AdamW(model.parameters(), lr=config.get("lr", 0.01)) if diloco
             else torch.optim.SGD(model.parameters(), lr=config.get("lr", 0.1), momentum=0.9))
    rg = replica_group(model, optim, config, diloco=diloco,
                       lr_scaling=config.get("lr_scaling", "none"))
    rank, size = dist.get_rank(), dist.get_world_size()
    log = Path(config["log_dir"]) / f"g{gid}.jsonl" if config.get("log_dir") else None
    if log:
        log.parent.mkdir(parents=True, exist_ok=True)
    if config.get("fail"):  # the test of a train function that raises at once
        raise FileNotFoundError(config["fail"])
    rg.commit()
    while rg.running:
        t0 = time.monotonic()
        held = list(rg.ranges)
        loss = torch.zeros(())
        for ids in (rg.inner_batches(rank, size) if diloco else [rg.sample_ids(rank, size)]):
            x, y = samples(ids)
            burn(len(ids), config.get("work", 0))
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            if diloco:
                optim.step()
                optim.zero_grad()
        time.sleep(max(0.0, config.get("step_s", 0.0) - (time.monotonic() - t0)))
        before = rg.step
        _maybe_kill(config, gid, before + 1)
        t1 = time.monotonic()
        if log and rank == 0 and held:
            replica_check.write_held(log.parent, gid, before + 1, held, rg.incarnation)
        contributes = rg.commit()
        t2 = time.monotonic()
        if log and rank == 0 and contributes and rg.last.contributes and rg.step > before:
            with log.open("a") as f:
                f.write(json.dumps({"step": rg.step, "ranges": held, "loss": float(loss.detach()),
                                    "groups": len(rg.last.members), "t": time.time(),
                                    "contributors": len(rg.last.contributors),
                                    "compute_s": t1 - t0, "commit_s": t2 - t1,
                                    "waited_s": rg.last.waited_s,
                                    "attempt": rg.incarnation}) + "\n")
    rg.finish()
    got = torch.tensor([float(rg.stats["rejoin_bytes"])])
    dist.all_reduce(got)  # the group's total: every inner rank received its shards
    final = {"eval_loss": eval_loss(model), "step": rg.step, **rg.metrics(),
             "rejoin_bytes_group": float(got), "heal_s": rg.stats["heal_s"]}
    if log and rank == 0:
        with (Path(config["log_dir"]) / f"g{gid}.final.json").open("a") as f:
            f.write(json.dumps({**final, "attempt": rg.incarnation}) + "\n")
    ray_mesh.report(final)
