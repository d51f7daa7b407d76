"""One replica group under torchrun, for tests/dist/test_replica_layouts.py (no Ray).

argv: GROUP LAYOUT COORDINATOR_PORT STEPS OUT_DIR. LAYOUT: ``plain`` (no sharding),
``fsdp`` (FSDP2 over the group's ranks), ``tp`` (tensor parallel over them). ``DILOCO_EVERY``
set: DiLoCo replica groups (AdamW inner steps, the outer step at each commit). The group
reaches the run's coordinator (a ``Quorum`` served by the test process through a
``multiprocessing`` manager) and trains harness/replica_train.py's MLP with
``exchange="full"``. Rank 0 writes ``g<GROUP>.jsonl`` (one line per committed step: the
samples behind it, and when) and ``g<GROUP>.pt`` (the final full parameters); every rank
writes ``lanes_g<GROUP>_r<RANK>`` (the bytes its lane of the exchange carried).

``DIE_AT_STEP`` set: once this group's rank 1 holds that step (0: as the group joins), it
exits before meeting the others; rank 0 then fails in the boundary, reports the error to the
coordinator as ray_mesh's Ray glue does (``_guarded``), and exits. Its rank 0 ignores
SIGTERM, which torchrun sends it as soon as rank 1 is gone (Ray Train's teardown of a group
also takes a moment; the report is what ends the group's membership at once).

``CKPT_DIR`` set: the run's fallback checkpoint every ``CKPT_EVERY`` steps into it (a bucket
URI at ``CKPT_ENDPOINT``). ``LEAVE_AT_STEP`` set: once the group holds that step, it waits
for its upload, rank 0 writes ``g<GROUP>.leave.pt`` (the full parameters and optimizer
state) and the whole group exits without finishing: every group is gone. After its first
commit (a restore, when the run is in that state), rank 0 writes ``g<GROUP>.first.pt``.

``JOIN_AFTER`` set (a path): the group starts (torch, its process group, its model) but
joins the run (registers with the coordinator) only once that file exists: a test starts a
late or joining group ahead and lets it in when its turn comes, without waiting out its
start then.

``RUNS`` set (a JSON list of ``{"port", "steps", "out", "env"}``): the group takes part in
those runs one after the other, each on its own quorum (``port``) with a fresh model and
optimizer, ``env`` overriding ``COMPRESS`` / ``DILOCO_EVERY`` for that run (argv's PORT STEPS
OUT are then ignored): the tests of a pair of layouts pay one torchrun start for all their
runs, not one each.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from multiprocessing.managers import BaseManager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from harness.replica_train import eval_loss, make_model, samples
from ray_mesh import shutdown_mesh
from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.replicas import ReplicaGroup

AUTHKEY = b"replica-layouts"


class Manager(BaseManager):
    pass


Manager.register("coordinator")


def build(layout: str, size: int) -> nn.Module:
    model = make_model()
    if layout == "plain":
        return model
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("dp_shard" if layout == "fsdp"
                                                            else "tp",))
    if layout == "fsdp":
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh)
        return fully_shard(model, mesh=mesh)
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def main() -> None:
    gid, layout = int(sys.argv[1]), sys.argv[2]
    # PG_TIMEOUT_S: the group's own collectives' bound (MeshConfig's hang watch sets
    # hang_timeout_s + 15 s), to show a long quorum wait does not trip it
    timeout = float(os.environ.get("PG_TIMEOUT_S", "600"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
    runs = json.loads(os.environ.get("RUNS") or "null") or [
        {"port": int(sys.argv[3]), "steps": int(sys.argv[4]), "out": sys.argv[5]}]
    for run in runs:
        train(gid, layout, int(run["port"]), int(run["steps"]), Path(run["out"]),
              {**os.environ, **run.get("env", {})})
    # not a bare destroy_process_group(): every run's mesh keeps its gloo group alive till
    # interpreter exit, where a gloo worker can abort the rank after its last line
    # (ray_mesh.core.teardown); shutdown_mesh frees them all with the interpreter whole
    shutdown_mesh()


def train(gid: int, layout: str, port: int, steps: int, out: Path,
          env: Mapping[str, str]) -> None:
    """One run: this group on the quorum at ``port``, from a fresh model to the end."""
    rank, size = dist.get_rank(), dist.get_world_size()
    manager = Manager(address=("127.0.0.1", port), authkey=AUTHKEY)
    manager.connect()
    model = build(layout, size)
    wait_for(env.get("JOIN_AFTER"))
    every = int(env.get("DILOCO_EVERY", "0"))
    diloco = DiLoCoConfig(every=every, outer_lr=0.7, outer_momentum=0.9) if every else None
    optim = (torch.optim.AdamW(model.parameters(), lr=0.01) if diloco else
             torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    rg = ReplicaGroup(model, optim, client=manager.coordinator(), group_id=gid,
                      total_steps=steps, segment_samples=8, exchange="full",
                      layout=f"{layout}={size}", timeout_s=20, diloco=diloco,
                      compress=env.get("COMPRESS", "none"),
                      checkpoint_dir=env.get("CKPT_DIR") or None,
                      checkpoint_every=int(env.get("CKPT_EVERY", "0")),
                      checkpoint_endpoint=env.get("CKPT_ENDPOINT") or None)
    leave_at = int(env.get("LEAVE_AT_STEP", "-1"))
    dp_rank, dp_size = (rank, size) if layout == "fsdp" else (0, 1)
    die_at = int(env.get("DIE_AT_STEP", "-1"))
    if die_at >= 0:  # rank 0 outlives torchrun's SIGTERM long enough to report (see above)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def commit() -> None:
        if rg.step == die_at and rank == 1:  # its step computed, not yet met
            os._exit(3)
        try:
            rg.commit()
        except RuntimeError as exc:
            if die_at < 0:
                raise
            # the group's own failure, reported as the Ray glue reports it
            manager.coordinator().failed(gid, str(exc)[:200], rank, rg.incarnation)
            print(f"FAILED group {gid} rank {rank} at step {rg.step}", flush=True)
            os._exit(3)

    commit()
    dump(model, optim, rank, out / f"g{gid}.first.pt")
    while rg.running:
        held = list(rg.ranges)
        if diloco:  # the round's inner steps on this group's own
            for ids in rg.inner_batches(dp_rank, dp_size):
                x, y = samples(ids)
                nn.functional.mse_loss(model(x), y).backward()
                optim.step()
                optim.zero_grad()
        else:
            x, y = samples(rg.sample_ids(dp_rank, dp_size))
            nn.functional.mse_loss(model(x), y).backward()
        # STEP_S a step until WAIT_GROUPS groups take part (a joiner finds steps left),
        # then at full speed.
        alone = len(rg.last.members) < int(env.get("WAIT_GROUPS", "0"))
        time.sleep(float(env.get("STEP_S", "0.05")) if alone else 0.0)
        before = rg.step
        commit()
        if rank == 0 and rg.step > before:
            with (out / f"g{gid}.jsonl").open("a") as f:
                f.write(json.dumps({"step": rg.step, "ranges": held, "t": time.time(),
                                    "contributes": rg.last.contributes,
                                    "groups": len(rg.last.members)}) + "\n")
        if rg.step == leave_at:  # every group gone: the run's fallback is all that is left
            rg.fallback.close()
            dump(model, optim, rank, out / f"g{gid}.leave.pt")
            print(f"LEFT group {gid} at step {rg.step}: {rg.fallback.uploaded}", flush=True)
            dist.barrier()
            os._exit(0)
    rg.finish()
    # the bytes this rank's lane carried, per run (a group's stdout holds all its runs)
    (out / f"lanes_g{gid}_r{rank}").write_text(str(rg.stats["lane_bytes"]))
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for p in model.parameters()]
    if rank == 0:
        torch.save([t.clone() for t in full], out / f"g{gid}.pt")
        print(f"DONE group {gid} step {rg.step} healed_bytes {rg.stats['rejoin_bytes']}",
              flush=True)
    loss = eval_loss(model)  # every rank: a sharded model's forward is a collective
    if rank == 0:
        (out / f"g{gid}.eval").write_text(str(loss))


def wait_for(path: str | None, timeout_s: float = 300.0) -> None:
    """Until ``path`` exists (JOIN_AFTER); bounded, so a test that never opens it fails."""
    deadline = time.monotonic() + timeout_s
    while path and not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


def dump(model: nn.Module, optim: torch.optim.Optimizer, rank: int, path: Path) -> None:
    """The full parameters and SGD momentum (a collective for sharded ones), from rank 0."""
    def full(t: torch.Tensor) -> torch.Tensor:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()

    params = [full(p) for p in model.parameters()]
    momenta = [full(optim.state[p]["momentum_buffer"]) for p in model.parameters()
               if "momentum_buffer" in optim.state.get(p, {})]
    if rank == 0:
        torch.save({"params": params, "momenta": momenta}, path)


if __name__ == "__main__":
    main()
