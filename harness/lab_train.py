"""The LM's replica-group loop with a step log: ``examples/llm.py``'s ``train_as_group`` run
exactly as its ``train_groups`` runs it, each group's ``commit`` wrapped to write down what
it did (loaded by path, shipped by value; ``harness/lab_job.py`` points the job's ``train:``
here).

With ``config["step_log"]`` (a directory every node reaches), each group's rank 0 appends
one JSON line per committed step its samples entered (the sample ranges behind its
contribution, the groups present, the time, its attempt) to ``g<i>.jsonl``, and one line
per finished attempt (the held-out loss the loop evaluated at the end, the bytes and seconds
its heal took) to ``g<i>.final.json``: the format ``harness/replica_check.py`` reads; one
line per optimizer step to ``g<i>.inner.jsonl`` (DiLoCo's inner steps: a survivor's pause
read per step); and one line per attempt to ``g<i>.phases.jsonl``: when its worker process
and its train function started, when its group was made (registered with the quorum) and
when its first commit returned (joined, healed) -- where a rejoin's seconds go.

``ref_segment`` (the reference run, :mod:`harness.lab_reference`): the same loop as one
group on a quorum in this process.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import psutil
import torch.distributed as dist

from harness import replica_check

LLM = Path(__file__).resolve().parents[1] / "examples" / "llm.py"


def example() -> Any:
    """``examples/llm.py`` as a module (it is a file, not part of a package)."""
    spec = importlib.util.spec_from_file_location("ray_mesh_lab_llm", LLM)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def logged(rg: Any, log_dir: Path | None) -> Any:
    """``rg`` with its ``commit`` writing one line per committed step (rank 0)."""
    if log_dir is None:
        return rg
    inner = rg.commit
    rank = dist.get_rank()

    def commit() -> bool:
        held, before = list(rg.ranges), rg.step
        if rank == 0 and held:
            replica_check.write_held(log_dir, rg.gid, before + 1, held, rg.incarnation)
        stepped = inner()
        if rank == 0 and stepped and rg.last.contributes and rg.step > before:
            with (log_dir / f"g{rg.gid}.jsonl").open("a") as f:
                f.write(json.dumps({"step": rg.step, "ranges": held, "t": time.time(),
                                    "groups": len(rg.last.members),
                                    "contributors": len(rg.last.contributors),
                                    "waited_s": rg.last.waited_s,
                                    "attempt": rg.incarnation}) + "\n")
        return stepped

    rg.commit = commit
    return rg


def run_logged(config: dict, make_group: Any) -> dict:
    """``train_as_group`` with every group it makes logged, and the final line written."""
    log_dir = Path(config["step_log"]) if config.get("step_log") else None
    made: list[Any] = []
    # the worker's process start (Ray scheduled it), its train function's start
    phases = {"t_proc": psutil.Process().create_time(), "t_fn": time.time()}

    def make(model: Any, optim: Any, **kw: Any) -> Any:
        rg = logged(make_group(model, optim, **kw), log_dir)
        phases["t_group"] = time.time()
        made.append(rg)
        if log_dir is not None and dist.get_rank() == 0:
            def stepped(*_: Any) -> None:  # every optimizer step: DiLoCo's inner ones too
                with (log_dir / f"g{rg.gid}.inner.jsonl").open("a") as f:
                    f.write(json.dumps({"step": rg.step, "t": time.time(),
                                        "attempt": rg.incarnation}) + "\n")

            optim.register_step_post_hook(stepped)
            first = rg.commit

            def commit() -> bool:  # the first one: joined the run (healed if behind)
                rg.commit = first
                try:
                    return first()
                finally:
                    phases.update(t_joined=time.time(), step=rg.step)
                    with (log_dir / f"g{rg.gid}.phases.jsonl").open("a") as f:
                        f.write(json.dumps({**phases, "attempt": rg.incarnation}) + "\n")

            rg.commit = commit
        return rg

    summary = example().train_as_group(config, make)
    if log_dir is not None and made and dist.get_rank() == 0:
        rg = made[-1]
        final = {"step": rg.step, "eval_loss": summary.get("val_loss"),
                 "samples": summary.get("samples"), "tokens_per_s": summary.get("tokens_per_s"),
                 "rejoin_bytes": rg.stats["rejoin_bytes"], "heal_s": rg.stats["heal_s"],
                 "restored_from": rg.stats.get("restored_from"), "attempt": rg.incarnation}
        with (log_dir / f"g{rg.gid}.final.json").open("a") as f:
            f.write(json.dumps(final) + "\n")
    return summary


def train_groups(config: dict) -> dict:
    """``examples/llm.py:train_groups`` with the step log (see the module docstring)."""
    from ray_mesh.raytrain.replica_groups import replica_group

    return run_logged(config, lambda model, optim, **kw: replica_group(model, optim, config,
                                                                       **kw))
