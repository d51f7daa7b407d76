"""One LM replica group under torchrun, for tests/dist/test_lm_groups.py (no Ray).

argv: GROUP LAYOUT COORDINATOR_PORT STEPS OUT_DIR. LAYOUT: ``fsdp`` (``dp_shard`` over the
group's ranks) or ``plain`` (one rank). The group runs ``examples/llm.py``'s own
replica-group loop (``train_as_group``) on the job's ``data:`` read by index (each group
builds its ``TokenSamples`` from this machine's files), with a ``ReplicaGroup`` on the
test's local quorum (``local_quorum.py``) instead of Ray's coordinator. Its commit is
wrapped: rank 0 appends one line per committed step to ``g<GROUP>.jsonl`` (the sample
ranges behind its contribution, the groups present, when) and writes ``g<GROUP>.pt`` (the
final full parameters) and ``g<GROUP>.json`` (the loop's summary).

``DIE_AT_STEP`` set: when the group holds that step, its rank 1 exits before meeting the
others; rank 0 then fails in the boundary, reports it to the coordinator as ray_mesh's Ray
glue does, and exits (rank 0 ignores torchrun's SIGTERM meanwhile). ``ALONE_STEP_S``: a
step's floor while fewer than ``WAIT_GROUPS`` groups take part (a rejoining group finds
steps left). ``MANIFEST``: the test's manifest of the data, which each group's own reading of
the files must give. ``DILOCO_EVERY``: DiLoCo groups (``config.diloco``), that many inner
steps a round (``DILOCO_COMPRESS``: their ``compress``). ``JOIN_AFTER`` (a path): the
group starts (torch, its mesh, its data and model) but joins the run (makes its
``ReplicaGroup``) only once that file exists: the test starts a restarted group ahead and
lets it in when the dead one is gone.

``THEN`` set (JSON ``{"port", "steps", "out", "env"}``): once its run is over, the group takes
part in a second run on that quorum, from a fresh model, with ``env`` as its only settings
above (the first run's are not inherited): the DiLoCo test's run rides on the processes of
the rejoin test's, not on a torchrun start of its own.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_quorum import connect  # noqa: E402

import ray_mesh  # noqa: E402
from ray_mesh.replicas import ReplicaGroup  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {"model": {"preset": "tiny", "max_seq_len": 64}, "lr": 0.003, "warmup": 2,
          "report_every": 5, "eval_every": 10_000, "grad_clip": 1.0,
          "data": {"paths": ["stdlib"], "seq_len": 32, "batch_size": 8, "validation": 0.05,
                   "max_tokens": 60_000, "val_tokens": 4096}}
SEGMENT = 8


def _example():
    spec = importlib.util.spec_from_file_location("llm_example", ROOT / "examples" / "llm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    gid, layout, port, steps, out = (int(sys.argv[1]), sys.argv[2], int(sys.argv[3]),
                                     int(sys.argv[4]), Path(sys.argv[5]))
    ray_mesh.init_mesh(ray_mesh.MeshSpec.from_dict({"dp_shard": -1}))
    train(gid, layout, port, steps, out, os.environ)
    then = json.loads(os.environ.get("THEN") or "null")
    if then:
        train(gid, layout, int(then["port"]), int(then["steps"]), Path(then["out"]),
              {"MANIFEST": os.environ.get("MANIFEST", ""), **then.get("env", {})})
    ray_mesh.shutdown_mesh()


def train(gid: int, layout: str, port: int, steps: int, out: Path,
          env: Mapping[str, str]) -> None:
    """One run: this group on the quorum at ``port``, from a fresh model to the end."""
    rank = dist.get_rank()
    size = dist.get_world_size()
    die_at = int(env.get("DIE_AT_STEP", "-1"))
    alone_s, wait = float(env.get("ALONE_STEP_S", "0")), int(env.get("WAIT_GROUPS", "0"))
    if die_at >= 0:  # rank 0 outlives torchrun's SIGTERM long enough to report (see above)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    client = connect(port)
    config = {**CONFIG, "data_index": {"manifest": env.get("MANIFEST") or None}}
    if env.get("DILOCO_EVERY"):  # DiLoCo groups: AdamW inner steps, commit = outer
        config["diloco"] = {"every": int(env["DILOCO_EVERY"]), "outer_lr": 0.7,
                            "outer_momentum": 0.9,
                            "compress": env.get("DILOCO_COMPRESS", "none")}
    box: dict = {}

    def make_group(model, optim, **kwargs) -> ReplicaGroup:
        gate, until = env.get("JOIN_AFTER"), time.monotonic() + 300
        while gate and not os.path.exists(gate):
            if time.monotonic() > until:
                raise TimeoutError(f"{gate} did not appear within 300 s")
            time.sleep(0.05)
        rg = ReplicaGroup(model, optim, client=client, group_id=gid, total_steps=steps,
                          segment_samples=SEGMENT, exchange="full", layout=f"{layout}={size}",
                          timeout_s=20, **kwargs)
        inner = rg.commit

        def commit() -> bool:
            held, before = list(rg.ranges), rg.step
            if rg.last is not None and len(rg.last.members) < wait:
                time.sleep(alone_s)
            if rg.step == die_at and rank == 1:  # its step computed, not yet met
                os._exit(3)
            try:
                stepped = inner()
            except RuntimeError as exc:
                if die_at < 0:
                    raise
                client.failed(gid, str(exc)[:200], rank, rg.incarnation)
                print(f"FAILED group {gid} rank {rank} at step {rg.step}", flush=True)
                os._exit(3)
            if rank == 0 and stepped and rg.last.contributes and rg.step > before:
                with (out / f"g{gid}.jsonl").open("a") as f:
                    f.write(json.dumps({"step": rg.step, "ranges": held, "t": time.time(),
                                        "groups": len(rg.last.members),
                                        "attempt": rg.incarnation}) + "\n")
            return stepped

        rg.commit = commit
        box["model"] = model
        return rg

    summary = _example().train_as_group(config, make_group)
    full = [p.full_tensor() if isinstance(p, DTensor) else p.detach()
            for p in box["model"].parameters()]
    if rank == 0:
        torch.save([t.clone() for t in full], out / f"g{gid}.pt")
        (out / f"g{gid}.json").write_text(json.dumps(summary))
        print(f"DONE group {gid} step {summary['step']}", flush=True)


if __name__ == "__main__":
    main()
