"""DiLoCo on the replicate dim: replicas train apart for H steps, then sync once.

Over a VPN the replicate dim is the one that crosses nodes. Sync HSDP all-reduces every
gradient over it every step; DiLoCo (Douillard et al., 2023) lets each replica (one node's
FSDP / TP group) take ``every`` inner optimizer steps with no traffic across nodes, then:

1. each rank forms the pseudo-gradient of its own shard, ``global - local``;
2. averages it over ``dp_replicate`` only (optionally compressed, :mod:`.compress`);
3. applies the outer optimizer to the global parameters: SGD with Nesterov momentum,
   ``m = mu m + d``; ``global -= lr (d + mu m)`` (``lr (mu m)`` without Nesterov);
4. copies the new global parameters into the model, so replicas continue from the same
   point (bitwise: every replica decodes the same average).

Defaults follow the paper: outer lr 0.7, momentum 0.9, Nesterov. With ``every=1``, outer
lr 1 and momentum 0, an SGD inner optimizer gives exactly sync data parallel (the mean of
the replicas' SGD steps), which the tests check against sync HSDP.

Streaming (``streaming=k``): the parameters are cut into k fragments of similar size, and
fragment f syncs at the inner steps where ``(step - f * every / k) % every == 0``: each
fragment still syncs every H steps, but the link carries 1/k of the model k times as
often instead of all of it in one burst (Streaming DiLoCo, Douillard et al. 2025).

The model must be sharded inside a replica only: ``apply_fsdp(model, mesh, mode="replica")``
(or ``parallelize(..., dp="replica")``).

Checkpoints (:meth:`DiLoCo.save` / :meth:`DiLoCo.load`, DCP): between syncs the replicas
hold *different* parameters and inner optimizer states, and DCP keeps one copy of chunks
that several ranks hold at the same offsets. So each replica's model and optimizer state
go under a key of its own (``replica<r>``), and the outer state (global parameters, outer
momentum, error feedback, counters), equal on every replica, once. A replica index that the
checkpoint does not have (more nodes than when it was saved) starts from the global
parameters with a fresh inner optimizer, as a joining replica should.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ray_mesh.parallel.compress import MODES, average_and_own, wire_bytes
from ray_mesh.parallel.errors import ParallelError


@dataclass(frozen=True)
class DiLoCoConfig:
    """The replicate dim's DiLoCo settings (YAML: ``replicate: {mode: diloco, ...}``)."""

    every: int = 50
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    compress: str = "none"
    error_feedback: bool = True
    streaming: int = 1

    def __post_init__(self) -> None:
        def bad(key: str, why: str) -> ParallelError:
            return ParallelError(f"replicate.{key}={getattr(self, key)!r}: {why}")

        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise bad("every", "give the inner steps between syncs, an integer >= 1 "
                               "(tens to hundreds at this scale; the paper used 500)")
        if (isinstance(self.outer_lr, bool) or not isinstance(self.outer_lr, int | float)
                or not 0 < self.outer_lr <= 10 or math.isnan(self.outer_lr)):
            raise bad("outer_lr", "give a number in (0, 10]; 0.7 is the paper's")
        if (isinstance(self.outer_momentum, bool)
                or not isinstance(self.outer_momentum, int | float)
                or not 0 <= self.outer_momentum < 1):
            raise bad("outer_momentum", "give a number in [0, 1); 0.9 is the paper's")
        if not isinstance(self.nesterov, bool) or not isinstance(self.error_feedback, bool):
            raise ParallelError("replicate.nesterov and replicate.error_feedback must be "
                                "true or false")
        if self.compress not in MODES:
            raise bad("compress", f"use one of {', '.join(MODES)}")
        if (isinstance(self.streaming, bool) or not isinstance(self.streaming, int)
                or not 1 <= self.streaming <= self.every):
            raise bad("streaming", f"give the number of fragments, an integer in "
                                   f"[1, every={self.every}]")

    @classmethod
    def from_dict(cls, data: Any) -> DiLoCoConfig:
        if not isinstance(data, dict):
            raise ParallelError(f"replicate: {data!r} must be a mapping like "
                                "{mode: diloco, every: 50}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known - {"mode"})
        if unknown:
            raise ParallelError(f"replicate: unknown key(s) {unknown}; known: mode, "
                                f"{', '.join(sorted(known))}")
        return cls(**{k: v for k, v in data.items() if k != "mode"})


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _fragments(sizes: list[int], k: int) -> list[list[int]]:
    """Parameter indices cut into k fragments of similar size, each a run of consecutive
    parameters (so a fragment is whole layers, as torchft's model fragments are)."""
    total = sum(sizes)
    out: list[list[int]] = [[] for _ in range(k)]
    acc = 0
    for i, n in enumerate(sizes):
        f = min(k - 1, int(acc * k / max(total, 1)))
        out[f].append(i)
        acc += n
    return [f for f in out if f] or [list(range(len(sizes)))]


class DiLoCo:
    """The outer loop of DiLoCo around a model and its inner optimizer.

    Call :meth:`step` after every inner ``optimizer.step()``; it syncs when due and says
    whether it did. ``mesh`` must have a ``dp_replicate`` dim of size >= 2.
    """

    def __init__(self, model: torch.nn.Module, mesh: DeviceMesh,
                 config: DiLoCoConfig | None = None, *, dim: str = "dp_replicate") -> None:
        self.config = config or DiLoCoConfig()
        try:
            rep_mesh = mesh[dim]
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ParallelError(f"DiLoCo needs a {dim!r} dim on the mesh (dims: "
                                f"{mesh.mesh_dim_names})") from exc
        self.replicas = rep_mesh.size()
        if self.replicas < 2:
            raise ParallelError(f"DiLoCo syncs replicas over {dim!r}, which has size "
                                f"{self.replicas}: use a mesh with dp_replicate >= 2 (one "
                                "replica per node), or replicate mode 'sync'")
        self.group = rep_mesh.get_group()
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ParallelError("DiLoCo got a model without trainable parameters")
        for p in self.params:
            if isinstance(p, DTensor) and dim in (p.device_mesh.mesh_dim_names or ()):
                raise ParallelError(
                    f"the model is sharded or replicated over {dim!r} (HSDP): its gradients "
                    "would still be all-reduced across replicas every step. Shard it inside a "
                    "replica only: parallelize(model, mesh, dp='replica')")
        with torch.no_grad():
            self.global_params = [_local(p).detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(g) for g in self.global_params]
        self.error = ([torch.zeros_like(g) for g in self.global_params]
                      if self.config.compress == "int8" and self.config.error_feedback else None)
        self.fragments = _fragments([g.numel() for g in self.global_params],
                                    self.config.streaming)
        self.inner_steps = 0
        self.outer_steps = 0
        self.stats: dict[str, float] = {"bytes_sent": 0.0, "sync_s": 0.0, "drift": 0.0}

    # ------------------------------------------------------------------ schedule
    def due(self, step: int) -> list[int]:
        """Fragments that sync after inner step ``step`` (1-based)."""
        h, k = self.config.every, len(self.fragments)
        return [f for f in range(k) if (step - (f * h) // k) % h == 0 and step >= h]

    def step(self) -> bool:
        """Count one inner step; sync the fragments that are due. True when one synced."""
        self.inner_steps += 1
        due = self.due(self.inner_steps)
        for f in due:
            self.sync(self.fragments[f])
        return bool(due)

    # ------------------------------------------------------------------ the outer step
    @torch.no_grad()
    def sync(self, indices: Iterable[int] | None = None) -> None:
        """Average pseudo-gradients over the replicas and take the outer step.

        The pseudo-gradients of one sync travel as one flat buffer per dtype: one collective
        (two for int8: codes and scales) instead of one or two per tensor, with no per-tensor
        padding to a chunk; on a VPN each message pays headers and a round trip.
        """
        cfg = self.config
        idx = list(range(len(self.params))) if indices is None else list(indices)
        t0 = time.perf_counter()
        drift = 0.0
        buckets: dict[torch.dtype, list[int]] = {}
        for i in idx:
            buckets.setdefault(self.global_params[i].dtype, []).append(i)
        for ids in buckets.values():
            deltas = []
            for i in ids:
                delta = self.global_params[i] - _local(self.params[i]).detach()
                drift += float(delta.float().pow(2).sum())
                if self.error is not None:
                    delta = delta + self.error[i]
                deltas.append(delta)
            flat = torch.cat([d.reshape(-1) for d in deltas])
            avg, own = average_and_own(flat, cfg.compress, self.group)
            lost = flat - own if self.error is not None else None
            offset = 0
            for i, delta in zip(ids, deltas, strict=True):
                n = delta.numel()
                if lost is not None:
                    self.error[i] = lost[offset:offset + n].view_as(delta).clone()
                self._outer_update(i, avg[offset:offset + n].view_as(delta))
                offset += n
            self.stats["bytes_sent"] += wire_bytes(flat.numel(), cfg.compress)
        self.stats["sync_s"] += time.perf_counter() - t0
        self.stats["drift"] = math.sqrt(drift)
        self.outer_steps += 1

    def _outer_update(self, i: int, avg: torch.Tensor) -> None:
        """Outer SGD (Nesterov optional) on parameter ``i``; the replica takes the result."""
        cfg = self.config
        m = self.momentum[i]
        m.mul_(cfg.outer_momentum).add_(avg)
        update = avg.add(m, alpha=cfg.outer_momentum) if cfg.nesterov else m
        self.global_params[i].sub_(update, alpha=cfg.outer_lr)
        _local(self.params[i]).copy_(self.global_params[i])


    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float | int]:
        """Numbers to pass to ``ray.train.report`` (or any logger), all plain scalars:

        - ``diloco/inner_step``, ``diloco/outer_step``: counters (an outer step per fragment
          sync with streaming);
        - ``diloco/bytes_sent``: bytes this rank put on the cross-node link for all syncs so
          far (compressed size), ``diloco/bytes_per_outer_step`` their mean per outer step;
        - ``diloco/sync_s``: seconds spent in syncs so far (the time the link was busy, as
          this rank saw it), ``diloco/sync_s_per_outer_step`` their mean;
        - ``diloco/drift``: L2 norm of this rank's shard of ``global - local`` just before
          the last sync, i.e. how far the replica had moved in its H steps.
        """
        n = max(self.outer_steps, 1)
        return {
            "diloco/inner_step": self.inner_steps,
            "diloco/outer_step": self.outer_steps,
            "diloco/bytes_sent": int(self.stats["bytes_sent"]),
            "diloco/bytes_per_outer_step": self.stats["bytes_sent"] / n,
            "diloco/sync_s": self.stats["sync_s"],
            "diloco/sync_s_per_outer_step": self.stats["sync_s"] / n,
            "diloco/drift": self.stats["drift"],
        }

    # ------------------------------------------------------------------ checkpoints
    def _as_param_layout(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for p, t in zip(self.params, tensors, strict=True):
            out.append(DTensor.from_local(t, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
                       if isinstance(p, DTensor) else t)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Outer state shared by all replicas, tensors laid out like the parameters (DCP
        saves and reshards it). The error feedback is each replica's own: see :meth:`save`."""
        return {
            "global": self._as_param_layout(self.global_params),
            "momentum": self._as_param_layout(self.momentum),
            "counters": torch.tensor([self.inner_steps, self.outer_steps]),
            "config": asdict(self.config),
        }

    def _replica_state(self, model: torch.nn.Module, optims: list) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optims)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        if self.error is not None:  # what rounding left out of this replica's last sync
            state["error"] = self._as_param_layout(self.error)
        return state

    def _replica_key(self) -> str:
        return f"replica{dist.get_group_rank(self.group, dist.get_rank())}"

    def checkpoint_state(self, model: torch.nn.Module, optimizers: list,
                         saved_keys: Iterable[str] | None = None) -> tuple[dict[str, Any], bool]:
        """The DCP state to save or load: this replica's model and optimizer under
        ``replica<r>``, the shared outer state under ``diloco``.

        For a load, ``saved_keys`` are the checkpoint's keys: the second value says whether
        this replica is in it (the ``replica<r>`` part is left out when it is not).
        """
        key = self._replica_key()
        mine = saved_keys is None or any(k.startswith(key + ".") for k in saved_keys)
        state: dict[str, Any] = {"diloco": self.state_dict()}
        if mine:
            state[key] = self._replica_state(model, optimizers)
        return state, mine

    def apply_checkpoint_state(self, state: dict[str, Any], model: torch.nn.Module,
                               optimizers: list, mine: bool) -> None:
        """Put a state loaded by DCP (from :meth:`checkpoint_state`) into model, optimizers
        and self; a replica that was not saved starts from the global parameters."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.load_state_dict(state["diloco"])
        if mine:
            own = state[self._replica_key()]
            set_state_dict(model, optimizers, model_state_dict=own["model"],
                           optim_state_dict=own["optim"])
            for dst, src in zip(self.error or [], own.get("error", []), strict=False):
                dst.copy_(_local(src))
        else:
            with torch.no_grad():
                for p, g in zip(self.params, self.global_params, strict=True):
                    _local(p).copy_(g)

    def save(self, path: str, model: torch.nn.Module,
             optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> None:
        """Model, inner optimizer and outer state into ``path`` (DCP; collective)."""
        import torch.distributed.checkpoint as dcp

        optims = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
        dcp.save(self.checkpoint_state(model, optims)[0], checkpoint_id=str(path))

    def load(self, path: str, model: torch.nn.Module,
             optimizers: torch.optim.Optimizer | list[torch.optim.Optimizer]) -> bool:
        """Restore what :meth:`save` wrote; False when this replica was not in it (it then
        starts from the global parameters with a fresh inner optimizer)."""
        import torch.distributed.checkpoint as dcp

        optims = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else optimizers
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        state, mine = self.checkpoint_state(model, optims, saved)
        dcp.load(state, checkpoint_id=str(path))
        self.apply_checkpoint_state(state, model, optims, mine)
        return mine

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config", asdict(self.config)) != asdict(self.config):
            raise ParallelError(f"the checkpoint's DiLoCo settings {state['config']} differ "
                                f"from this run's {asdict(self.config)}; resume with the same "
                                "replicate: section")
        for key, mine in (("global", self.global_params), ("momentum", self.momentum)):
            for dst, src in zip(mine, state[key], strict=True):
                dst.copy_(_local(src))
        self.inner_steps, self.outer_steps = (int(x) for x in state["counters"].tolist())


def replicas_equal(model: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """True when every replica holds bitwise the same parameters (for tests and checks)."""
    ok = torch.ones(1)
    for p in model.parameters():
        t = _local(p).detach().reshape(-1).float()
        peers = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(peers, t.contiguous(), group=group)
        if not all(torch.equal(peers[0], x) for x in peers):
            ok.zero_()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    return bool(ok.item())


__all__ = ["DiLoCo", "DiLoCoConfig", "replicas_equal"]
