"""The user job as one mesh, with a step log: ``examples/llm.py``'s ``train_loop`` run as it
is, its ``Saver`` (checkpoint every ``checkpoint_every`` steps, restore at the start of each
attempt) wrapped to write down each attempt's start step and each step's end on rank 0.

``benchmarks/user_job.py`` points a one-mesh job's ``train:`` here (loaded by path, shipped
by value) with ``config.step_log`` a directory every node reaches; the log is ``mesh.jsonl``:
``{"start": s, "t": ...}`` when an attempt resumed at step ``s`` (0: a fresh start), then
``{"step": n, "t": ...}`` after step ``n`` (``benchmarks.user_job_figures.mesh_lineage``
reads it).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

LLM = Path(__file__).resolve().parents[1] / "examples" / "llm.py"


def _write(log: Path | None, row: dict[str, Any]) -> None:
    import torch.distributed as dist

    if log is not None and dist.get_rank() == 0:
        with log.open("a") as f:
            f.write(json.dumps({**row, "t": time.time()}) + "\n")


def train_loop(config: dict) -> dict:
    """``examples/llm.py:train_loop`` with the step log (see the module docstring)."""
    spec = importlib.util.spec_from_file_location("ray_mesh_user_job_llm", LLM)
    llm = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(llm)  # type: ignore[union-attr]
    log = Path(config["step_log"]) / "mesh.jsonl" if config.get("step_log") else None

    class LoggedSaver(llm.Saver):
        def restore(self) -> int:
            start = super().restore()
            _write(log, {"start": start})
            return start

        def step(self, done: int, metrics: dict | None) -> None:
            super().step(done, metrics)
            _write(log, {"step": done})

    llm.Saver = LoggedSaver  # train_loop looks the class up in its module
    return llm.train_loop({k: v for k, v in config.items() if k != "step_log"})
