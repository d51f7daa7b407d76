"""A byte-level Llama language model on the standard library's own sources.

FSDP2 over dp x tensor parallel with sequence parallel over tp (default: dp_shard 2 x tp 2
on 4 CPU workers), optional activation checkpointing, AdamW with warm-up and a cosine
decay. Reports training loss, validation loss in bits per byte next to the text's unigram
(byte frequency) entropy, tokens/s per rank and in total, and writes sharded checkpoints.

    ray-mesh run examples/llm.yaml                       # Ray Data streams the training rows
    ray-mesh run examples/llm_groups.yaml                # replica groups, samples by index
    torchrun --nproc-per-node 4 examples/llm.py [examples/llm.yaml] [--config '{"steps": 50}']

Under Ray Train the training rows come from ``ray.train.get_dataset_shard("train")`` (the
job's ``data:`` section); under torchrun from memory, sharded by dp rank. Validation is in
memory on every rank either way. ``make_model``/``build``/``batch``/``loss_fn`` are
importable for tests (the same interface as the other examples).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import ray_mesh
from ray_mesh.checkpointing import sharded
from ray_mesh.core.runtime import in_ray_train
from ray_mesh.core.spec import load_yaml
from ray_mesh.data.checks import check_same_batch
from ray_mesh.data.spec import DataSpec
from ray_mesh.data.text import bits_per_byte, load_split
from ray_mesh.models import Llama, LlamaConfig, num_params, parallelize_llama
from ray_mesh.models.schedule import warmup_cosine
from ray_mesh.parallel import dp_mean, dp_size, local_batch_size, shard_batch

DEFAULTS: dict = {
    "model": {"preset": "small", "max_seq_len": 256},
    "data": {"paths": ["stdlib"], "seq_len": 128, "batch_size": 16, "validation": 0.05,
             "max_tokens": 2_000_000, "val_tokens": 32_768},
    "steps": 200, "lr": 3e-3, "min_lr_ratio": 0.1, "warmup": 20, "weight_decay": 0.1,
    "grad_clip": 1.0, "seed": 0, "sequence_parallel": True, "activation_checkpointing": False,
    "mixed_precision": None, "report_every": 10, "eval_every": 100, "checkpoint_every": 100,
    "check_peer_batches": 10, "checkpoint_dir": None, "step_times": False,
}


def merged(config: dict | None) -> dict:
    cfg = {**DEFAULTS, **(config or {})}
    cfg["model"] = {**DEFAULTS["model"], **(cfg.get("model") or {})}
    return cfg


def model_config(cfg: dict) -> LlamaConfig:
    return LlamaConfig.from_dict(merged(cfg)["model"])


def data_spec(cfg: dict) -> DataSpec:
    return DataSpec.from_dict(merged(cfg)["data"])


def make_model(cfg: dict | None = None) -> Llama:
    cfg = merged(cfg)
    torch.manual_seed(cfg["seed"])  # every rank builds the same weights
    return Llama(model_config(cfg))


def build(mesh, cfg: dict | None = None) -> nn.Module:
    """TP with sequence parallel on ``tp``, then FSDP2 per block over the dp dims."""
    cfg = merged(cfg)
    return parallelize_llama(make_model(cfg), mesh, sequence_parallel=cfg["sequence_parallel"],
                             activation_checkpointing=cfg["activation_checkpointing"],
                             mixed_precision=cfg["mixed_precision"])


def make_step(mesh, config: dict | None = None):
    """One training step of this job on ``mesh``: ``mesh: auto``'s ``plan.step`` (each
    candidate layout timed at bring-up, ``examples/llm_auto.yaml``). A fixed batch of random
    bytes in the global batch's shape: the trial times the step, not the data loader. The
    gradient precision follows the trial (``mixed_precision`` unset); no pipeline layouts."""
    cfg = merged(config)
    spec = data_spec(cfg)
    model = build(mesh, cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                              weight_decay=cfg["weight_decay"])
    rows = torch.randint(0, model_config(cfg).vocab_size, (spec.global_batch, spec.seq_len + 1),
                         generator=torch.Generator().manual_seed(0))
    tokens = shard_batch(rows, mesh).to(next(model.parameters()).device)

    def step() -> None:
        dp_mean(optimize(model, optim, tokens, cfg), mesh)  # the loop's loss mean: its call too
    return step


def optimize(model: nn.Module, optim: torch.optim.Optimizer, tokens: torch.Tensor,
             cfg: dict) -> torch.Tensor:
    """Forward, backward, clip, optimizer step on one batch of rows; returns the loss."""
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    if cfg["grad_clip"]:
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
    optim.step()
    optim.zero_grad()
    return loss


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


_ROWS: dict[tuple[str, str], tuple[torch.Tensor, float]] = {}
"""Read once per process. (A plain dict: Ray ships this file by value, and cloudpickle
would pickle an lru_cache wrapper by reference to a module the workers cannot import.)"""


def rows(cfg: dict, split: str) -> tuple[torch.Tensor, float]:
    """(packed rows, unigram entropy) of a split, read once per process."""
    key = (json.dumps(data_spec(cfg).to_dict(), sort_keys=True), split)
    if key not in _ROWS:
        _ROWS[key] = load_split(DataSpec.from_dict(json.loads(key[0])), split)
    return _ROWS[key]


def global_rows(step: int, cfg: dict) -> torch.Tensor:
    """The global batch of ``step`` from memory: a fresh seeded permutation every epoch, so
    the batch depends on the step alone and a resumed run reads what an unbroken one would."""
    spec = data_spec(cfg)
    data, _ = rows(cfg, "train")
    per = spec.global_batch
    per_epoch = len(data) // per
    if per_epoch == 0:
        raise ValueError(f"llm: {len(data)} training rows hold no global batch of {per}; add "
                         f"data (data.max_tokens) or lower data.batch_size.")
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(
        spec.shuffle_seed * 1_000_003 + epoch))
    return data[order[index * per:(index + 1) * per]]


def batch(step: int, cfg: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of the global batch of ``step``."""
    tokens = global_rows(step, merged(cfg))
    return tokens[:, :-1], tokens[:, 1:]


def ray_batches(local: int) -> Iterator[torch.Tensor] | None:
    """This rank's rows from the job's Ray Data ``train`` shard, epoch after epoch."""
    import ray.train

    try:
        shard = ray.train.get_dataset_shard("train")
    except (KeyError, ValueError, RuntimeError):
        shard = None
    if shard is None:
        return None

    def gen() -> Iterator[torch.Tensor]:
        while True:
            got = 0
            for b in shard.iter_torch_batches(batch_size=local, drop_last=True,
                                              dtypes=torch.int64):
                got += 1
                yield b["tokens"]
            if not got:
                raise ValueError(f"llm: this rank's Ray Data shard holds no batch of {local} "
                                 f"rows; add data (data.max_tokens) or lower data.batch_size.")
    return gen()


def lr_factor(step: int, cfg: dict) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine down to ``min_lr_ratio``."""
    return warmup_cosine(step, cfg["warmup"], cfg["steps"], cfg["min_lr_ratio"])


@torch.no_grad()
def evaluate(model: nn.Module, mesh, cfg: dict, local: int) -> tuple[float, float]:
    """(mean validation loss in nats per byte, unigram entropy of the validation bytes)."""
    data, entropy = rows(cfg, "validation")
    dp = dp_size(mesh)
    usable = (len(data) // dp) * dp
    mine = shard_batch(data[:usable], mesh)
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)
    model.eval()
    for start in range(0, len(mine), local):
        chunk = mine[start:start + local].to(device)
        loss = loss_fn(model(chunk[:, :-1]), chunk[:, 1:])
        total += torch.stack([loss.double() * chunk[:, 1:].numel(),
                              torch.tensor(float(chunk[:, 1:].numel()), device=device)])
    model.train()
    dist.all_reduce(total, group=mesh.get_group("dp"))
    return (total[0] / total[1]).item(), entropy


class Saver:
    """Sharded checkpoints: Ray Train's Checkpointer in Ray, plain DCP under torchrun."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer, cfg: dict) -> None:
        self.model, self.optim, self.cfg = model, optim, cfg
        self.every = cfg["checkpoint_every"]
        self.ray = in_ray_train()
        if self.ray:
            from ray_mesh.checkpointing import Checkpointer

            self.ckpt = Checkpointer(model, optim, every=self.every)
        else:
            self.dir = Path(cfg["checkpoint_dir"]) if cfg["checkpoint_dir"] else None
            self.group = sharded.checkpoint_group()

    def restore(self) -> int:
        if self.ray:
            return self.ckpt.restore().step
        if self.dir is None or not self.dir.is_dir():
            return 0
        newest_first = sorted(self.dir.glob("checkpoint_*"), reverse=True)
        path, skipped = sharded.newest_complete(newest_first)
        for why in skipped:
            _print(why)
        if path is None:
            return 0
        return sharded.load(path, self.model, self.optim, group=self.group).step

    def step(self, done: int, metrics: dict | None) -> None:
        """After step ``done``: report (Ray, when there are metrics) and save when due."""
        due = bool(self.every) and (done % self.every == 0 or done == self.cfg["steps"])
        if self.ray:
            if metrics is not None or due:
                self.ckpt.report(done, metrics or {}, data_position={"next_step": done},
                                 save=due)
            return
        if due and self.dir is not None:
            path = sharded.prepare_dir(self.dir / sharded.dir_name(done), self.group)
            sharded.save(path, self.model, self.optim, group=self.group)
            sharded.mark_complete(path, sharded.Progress(step=done), group=self.group)


def _print(*args: object) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def train_loop(config: dict) -> dict:
    """Train; returns (and prints on rank 0) the summary: losses, bits per byte, tokens/s.

    A resumed run continues at the checkpoint's step with the same schedule; its rows are
    exactly an unbroken run's under torchrun (they depend on the step alone), while a Ray
    Data stream starts over (Ray 2.60 cannot checkpoint a dataset's position).

    ``config`` has no default on purpose: Ray Train 2.60 passes the config only to a train
    function whose ``config`` parameter is required, and calls one with a default bare.
    """
    cfg = merged(config)
    mesh = ray_mesh.get_mesh()
    spec, mcfg = data_spec(cfg), model_config(cfg)
    spec.check_values()
    mcfg.check_seq_len(spec.seq_len, "data.seq_len")
    local = local_batch_size(spec.global_batch, mesh)
    model = build(mesh, cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                              weight_decay=cfg["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: lr_factor(s, cfg))
    saver = Saver(model, optim, cfg)
    start = saver.restore()
    with warnings.catch_warnings():  # replaying the schedule: no optimizer step is due
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(start):
            sched.step()
    stream = ray_batches(local) if in_ray_train() else None
    device = next(model.parameters()).device
    tokens_per_step = spec.global_batch * spec.seq_len
    _print(f"llm: {num_params(model) / 1e6:.2f}M parameters, {dist.get_world_size()} ranks "
           f"(dp {dp_size(mesh)} x tp {mesh['tp'].size()}), {tokens_per_step} tokens/step, "
           f"rows from {'Ray Data' if stream is not None else 'memory'}, start step {start}, "
           f"{cfg['steps']} steps, reports every {cfg['report_every']}")
    summary: dict = {"params": num_params(model), "losses": {}}
    # step_times: every step's seconds and, of those, the wait for its batch (benchmarks/llm.py)
    times: dict = {"loop_start_unix": time.time(), "step_s": [], "batch_wait_s": []}
    timer, timed_steps, window_loss = time.perf_counter(), 0, []
    for step in range(start, cfg["steps"]):
        began = time.perf_counter()
        tokens = next(stream) if stream is not None else shard_batch(global_rows(step, cfg),
                                                                     mesh)
        times["batch_wait_s"].append(time.perf_counter() - began)
        every = cfg["check_peer_batches"]
        if every and step % every == 0:
            check_same_batch(tokens, mesh, step=step)
        loss = optimize(model, optim, tokens.to(device), cfg)
        sched.step()
        window_loss.append(dp_mean(loss, mesh).item())  # waits for every dp rank's step
        times["step_s"].append(time.perf_counter() - began)
        timed_steps += 1
        done = step + 1
        metrics = None
        if done % cfg["report_every"] == 0 or done == cfg["steps"] or step == start:
            took = time.perf_counter() - timer
            total_tps = tokens_per_step * timed_steps / took
            # Under Ray Train, ray_mesh reads this report for the progress line (tokens/s
            # from the "tokens" count), the metrics and the run's summary.
            metrics = {"step": done, "loss": sum(window_loss) / len(window_loss),
                       "lr": sched.get_last_lr()[0], "tokens": done * tokens_per_step}
            summary["losses"][done] = metrics["loss"]
            if not saver.ray:
                _print(f"llm: step {done}/{cfg['steps']} loss {metrics['loss']:.4f} lr "
                       f"{metrics['lr']:.2e} tokens/s {total_tps:.0f} "
                       f"({total_tps / dist.get_world_size():.0f}/rank)")
            summary["tokens_per_s"] = total_tps
        if done % cfg["eval_every"] == 0 or done == cfg["steps"]:
            val, entropy = evaluate(model, mesh, cfg, local)
            metrics = {**(metrics or {"step": done}), "val_loss": val,
                       "val_bpb": bits_per_byte(val), "unigram_entropy_bpb": entropy}
            # Printed under Ray too: an evaluation is not a step's progress line, and bits per
            # byte below the text's unigram entropy is what shows the model learns.
            _print(f"llm: eval at step {done}: val loss {val:.4f}, val bits/byte "
                   f"{bits_per_byte(val):.3f} (unigram entropy {entropy:.3f} bits/byte)")
            summary.update(val_loss=val, val_bpb=bits_per_byte(val), unigram_bpb=entropy)
        saver.step(done, metrics)
        if metrics is not None:
            timer, timed_steps, window_loss = time.perf_counter(), 0, []
    if cfg["step_times"]:
        summary.update(times)
    return summary


def train_groups(config: dict) -> dict:
    """The LM as replica groups (``ray-mesh run examples/llm_groups.yaml``): one Ray Train
    run per group (``replica_groups:``), each training on the samples the run's quorum hands
    it, read by index from the job's ``data:`` (``ray_mesh.data.group_samples``), so that a
    group that leaves and rejoins neither skips nor repeats a sequence.

    ``config.diloco`` (``{every: 4, outer_lr: 0.7, ...}``, ``DiLoCoConfig``'s keys) makes
    them DiLoCo groups; ``replica_groups.segment_samples`` is then a whole round's samples.
    """
    from ray_mesh import replica_group

    return train_as_group(config, lambda model, optim, **kw: replica_group(model, optim,
                                                                          config, **kw))


def train_as_group(config: dict, make_group) -> dict:
    """The replica-group loop, with the group made by ``make_group(model, optimizer,
    diloco=...)``: ``ray_mesh``'s under Ray (:func:`train_groups`), or a ``ReplicaGroup`` on
    a local quorum (tests/helpers/_lm_groups.py runs it under torchrun, without Ray)."""
    from ray_mesh import DiLoCoConfig, report_progress
    from ray_mesh.data import group_samples
    from ray_mesh.parallel import dp_rank

    cfg = merged(config)
    mesh = ray_mesh.get_mesh()
    spec, mcfg = data_spec(cfg), model_config(cfg)
    mcfg.check_seq_len(spec.seq_len, "data.seq_len")
    data = group_samples(config)  # sample i: the same sequence in every group, every node
    model = build(mesh, cfg)
    optim = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95),
                              weight_decay=cfg["weight_decay"])
    diloco = DiLoCoConfig(**cfg["diloco"]) if cfg.get("diloco") else None
    rg = make_group(model, optim, diloco=diloco)
    schedule = {**cfg, "steps": rg.total_steps}  # the run's steps, not config.steps

    def set_lr(*_: object) -> None:  # at each optimizer step, from the run's step: a group
        for g in optim.param_groups:  # that heals inside commit() adopts the donor's step
            g["lr"] = cfg["lr"] * lr_factor(rg.step, schedule)  # before the step it takes
    optim.register_step_pre_hook(set_lr)
    rank, size = dp_rank(mesh), dp_size(mesh)  # tp peers read the same samples
    device = next(model.parameters()).device
    ranks = dist.get_world_size()
    _print(f"llm: {num_params(model) / 1e6:.2f}M parameters, group of {ranks}"
           f" rank{'s' if ranks != 1 else ''} (dp {size} x tp {mesh['tp'].size()}), "
           f"{len(data)} training rows of "
           f"{data.seq_len + 1} tokens by index, {'DiLoCo' if diloco else 'sync'}")
    summary: dict = {"params": num_params(model), "losses": {}, "data": data.fingerprint}
    trained, window, timed = 0, [], 0
    rg.commit()  # join the run: heal from a live group, get this group's samples
    timer = time.perf_counter()  # a rejoin's heal is not the first window's training time
    while rg.running:
        held = sum(n for _, n in rg.ranges)
        parts = (rg.inner_batches(rank, size) if diloco else [rg.sample_ids(rank, size)])
        for k, ids in enumerate(parts):
            group_n = sum(len((rg.inner_batches(r, size) if diloco
                               else [rg.sample_ids(r, size)])[k]) for r in range(size))
            window.append(_group_loss(model, data, ids, group_n, size, mesh, device))
            if cfg["grad_clip"]:  # this group's gradient (the average of clipped ones is too)
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
            if diloco:  # inner step on the group's own; the commit is the outer one
                optim.step()
                optim.zero_grad()
        before = rg.step
        stepped = rg.commit()  # average with the groups present, optimizer (outer) step
        if stepped and rg.last.contributes:  # this group's samples were in the average
            trained, timed = trained + held, timed + held
        if rg.running and (rg.step == before or rg.step % cfg["report_every"]):
            continue
        took = time.perf_counter() - timer
        loss = sum(window) / max(1, len(window))
        # tokens_per_s: this window's, by the loop's clock; the progress line shows it where
        # it has no rate of its own (a group's first report, after a late rejoin the only one)
        summary["tokens_per_s"] = timed * data.seq_len / took
        metrics = {"step": rg.step, "loss": loss, "lr": optim.param_groups[0]["lr"],
                   "samples": trained, "tokens": trained * data.seq_len,
                   "tokens_per_s": summary["tokens_per_s"], **rg.metrics()}
        summary["losses"][rg.step] = loss
        if rg.step % cfg["eval_every"] == 0 or not rg.running:
            val, entropy = evaluate(model, mesh, cfg, max(1, spec.global_batch // size))
            metrics.update(val_loss=val, val_bpb=bits_per_byte(val), unigram_entropy_bpb=entropy)
            _print(f"llm: eval at step {rg.step}: val loss {val:.4f}, val bits/byte "
                   f"{bits_per_byte(val):.3f} (unigram entropy {entropy:.3f} bits/byte)")
            summary.update(val_loss=val, val_bpb=bits_per_byte(val), unigram_bpb=entropy)
        report_progress("llm", metrics, rg.total_steps)  # the progress line: tokens/s
        window, timer, timed = [], time.perf_counter(), 0
    rg.finish()
    return {**summary, "step": rg.step, "samples": trained}


def _group_loss(model: nn.Module, data, ids: list[int], group_n: int, dp: int, mesh,
                device) -> float:
    """Forward and backward of this rank's samples, scaled so that the group's gradient
    (FSDP averages it over the ``dp`` ranks) is the mean over the group's tokens, however
    unevenly its samples split; a rank without samples runs one row at weight 0 (its
    collectives must still run). Returns the group's mean loss per token."""
    rows = data.batch(ids if ids else [0]).to(device)
    tokens = rows[:, 1:].numel() if ids else 0
    logits = model(rows[:, :-1])
    total = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(0, 1),
                            reduction="sum")
    per_token = max(1, group_n * (rows.shape[1] - 1))
    (total * (dp / per_token if ids else 0.0)).backward()
    stat = torch.stack([total.detach().double() * bool(ids),
                        torch.tensor(float(tokens), dtype=torch.float64, device=device)])
    dist.all_reduce(stat, group=mesh.get_group("dp"))
    return (stat[0] / stat[1].clamp(min=1)).item()


def _main() -> None:
    parser = argparse.ArgumentParser(description="torchrun entry point of the llm example")
    parser.add_argument("job", nargs="?", help="a job YAML (its config, data and mesh)")
    parser.add_argument("--config", default="{}", help="JSON merged over the config")
    args = parser.parse_args()
    job = load_yaml(Path(args.job)) if args.job else {}
    cfg = {**(job.get("config") or {}), **json.loads(args.config)}
    if job.get("data") or "data" in json.loads(args.config):
        cfg["data"] = {**(job.get("data") or {}), **json.loads(args.config).get("data", {})}
    ray_mesh.init_mesh(ray_mesh.MeshSpec.from_dict(job.get("mesh") or
                                                   {"dp_shard": -1, "tp": 2}))
    summary = train_loop(cfg)
    _print("llm: summary " + json.dumps(summary))
    ray_mesh.shutdown_mesh()


if __name__ == "__main__":
    _main()
