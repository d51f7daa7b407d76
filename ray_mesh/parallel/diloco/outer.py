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

Overlap (``overlap=t``): a fragment's pseudo-gradient leaves at its due step and its outer
update lands ``t`` inner steps later, while training goes on (the collectives run in the
process group's threads; torchft's ``fragment_sync_delay``). On a slow link this hides the
sync behind compute. The ``t`` steps the replica took meanwhile are kept: on landing,
``local = new_global + (local_now - local_at_send)``, so they enter the next sync's
pseudo-gradient instead of being thrown away. The global parameters stay bitwise equal on
every replica (:meth:`DiLoCo.globals_equal`); the replicas' own parameters differ by those
``t`` steps. :meth:`DiLoCo.flush` lands every sync in flight: call it after the last step;
checkpoints and :meth:`DiLoCo.sync` call it first (so a run that saves at step s lands at
s, and resumes bitwise like an uninterrupted run that saved there too).

The model must be sharded inside a replica only: ``apply_fsdp(model, mesh, mode="replica")``
(or ``parallelize(..., dp="replica")``).

Checkpoints (:func:`ray_mesh.checkpointing.replicas.save` / ``.load``, or the
``Checkpointer(diloco=...)`` of a Ray Train run): between syncs the replicas hold
*different* parameters and inner optimizer states, and DCP keeps one copy of chunks that
several ranks hold at the same offsets. So :meth:`DiLoCo.checkpoint_state` puts each
replica's model and optimizer state under a key of its own (``replica<r>``), and the outer
state (global parameters, outer momentum, error feedback, counters), equal on every replica,
once. A replica index that the checkpoint does not have (more nodes than when it was saved)
starts from the global parameters with a fresh inner optimizer, as a joining replica should.
The files themselves are written and read by ``ray_mesh.checkpointing`` (a layer above this
one), with the marker, manifest, random state and restricted loading every ray_mesh
checkpoint has.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ray_mesh.core.diloco_config import DiLoCoConfig
from ray_mesh.errors import ParallelError
from ray_mesh.parallel.compress import PendingAverage, start_average, wire_bytes
from ray_mesh.parallel.mesh import MeshOrState, mesh_of


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


@dataclass
class _Flight:
    """One sync on the way: per dtype bucket, its parameter indices, the average in flight
    and (with overlap) the replica's parameters when it left; lands at inner step ``at``."""

    parts: list[tuple[list[int], PendingAverage, list[torch.Tensor] | None]]
    at: int


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

    Stability: experimental
    """

    def __init__(self, model: torch.nn.Module, mesh: MeshOrState | None,
                 config: DiLoCoConfig | None = None, *, dim: str = "dp_replicate") -> None:
        self.config = config or DiLoCoConfig()
        mesh = None if mesh is None else mesh_of(mesh)
        if mesh is None:  # replica groups (ray_mesh.replicas) average across groups
            self.replicas, self.group = 1, None
        else:
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
        self._in_flight: list[_Flight] = []
        self.stats: dict[str, float] = {"bytes_sent": 0.0, "sync_s": 0.0, "drift": 0.0}

    # ------------------------------------------------------------------ schedule
    def due(self, step: int) -> list[int]:
        """Fragments that sync after inner step ``step`` (1-based)."""
        h, k = self.config.every, len(self.fragments)
        return [f for f in range(k) if (step - (f * h) // k) % h == 0 and step >= h]

    def step(self) -> bool:
        """Count one inner step; land the syncs whose time has come, start (or, without
        overlap, do) the fragments that are due. True when an outer update landed."""
        self.inner_steps += 1
        landed = False
        while self._in_flight and self._in_flight[0].at <= self.inner_steps:
            self._land(self._in_flight.pop(0))
            landed = True
        for f in self.due(self.inner_steps):
            flight = self._launch(self.fragments[f], self.inner_steps + self.config.overlap,
                                  in_flight=bool(self.config.overlap))
            if self.config.overlap:
                self._in_flight.append(flight)
            else:
                self._land(flight)
                landed = True
        return landed

    def flush(self) -> bool:
        """Land every sync in flight (overlap): after the last step, before a checkpoint.
        True when one landed."""
        landed = bool(self._in_flight)
        while self._in_flight:
            self._land(self._in_flight.pop(0))
        return landed

    # ------------------------------------------------------------------ the outer step
    @torch.no_grad()
    def sync(self, indices: Iterable[int] | None = None) -> None:
        """Average pseudo-gradients over the replicas and take the outer step, now (after
        landing any sync in flight). ``indices``: parameters to sync (default: all)."""
        self.flush()
        idx = list(range(len(self.params))) if indices is None else list(indices)
        self._land(self._launch(idx, self.inner_steps, in_flight=False))

    @torch.no_grad()
    def _launch(self, idx: list[int], at: int, in_flight: bool) -> _Flight:
        """Form the pseudo-gradients of ``idx`` and start averaging them; ``in_flight``: it
        lands after more inner steps, so keep the parameters as sent to carry those steps.

        They travel as one flat buffer per dtype: one collective (two for int8: codes and
        scales) instead of one or two per tensor, with no per-tensor padding to a chunk; on
        a VPN each message pays headers and a round trip.
        """
        cfg = self.config
        t0 = time.perf_counter()
        drift = 0.0
        buckets: dict[torch.dtype, list[int]] = {}
        for i in idx:
            buckets.setdefault(self.global_params[i].dtype, []).append(i)
        parts = []
        for ids in buckets.values():
            deltas = []
            for i in ids:
                delta = self.global_params[i] - _local(self.params[i]).detach()
                drift += float(delta.float().pow(2).sum())
                if self.error is not None:
                    delta = delta + self.error[i]
                deltas.append(delta)
            flat = torch.cat([d.reshape(-1) for d in deltas])
            pending = start_average(flat, cfg.compress, self.group)
            if self.error is not None:  # what rounding left out, for the next sync
                lost = flat - pending.own
                offset = 0
                for i, delta in zip(ids, deltas, strict=True):
                    n = delta.numel()
                    self.error[i] = lost[offset:offset + n].view_as(delta).clone()
                    offset += n
            sent = ([_local(self.params[i]).detach().clone() for i in ids] if in_flight
                    else None)
            parts.append((ids, pending, sent))
            self.stats["bytes_sent"] += wire_bytes(flat.numel(), cfg.compress)
        self.stats["sync_s"] += time.perf_counter() - t0
        self.stats["drift"] = math.sqrt(drift)
        return _Flight(parts, at)

    @torch.no_grad()
    def _land(self, flight: _Flight) -> None:
        """Wait for a sync's average and take the outer step with it."""
        t0 = time.perf_counter()
        for ids, pending, sent in flight.parts:
            avg = pending.wait()
            offset = 0
            for k, i in enumerate(ids):
                n = self.global_params[i].numel()
                local = _local(self.params[i])
                moved = local - sent[k] if sent is not None else None
                self._outer_update(i, avg[offset:offset + n].view_as(self.global_params[i]))
                if moved is not None:  # the steps taken while the sync was in flight
                    local.add_(moved)
                offset += n
        self.stats["sync_s"] += time.perf_counter() - t0
        self.outer_steps += 1

    def _outer_update(self, i: int, avg: torch.Tensor) -> None:
        """Outer SGD (Nesterov optional) on parameter ``i``; the replica takes the result."""
        cfg = self.config
        m = self.momentum[i]
        m.mul_(cfg.outer_momentum).add_(avg)
        update = avg.add(m, alpha=cfg.outer_momentum) if cfg.nesterov else m
        self.global_params[i].sub_(update, alpha=cfg.outer_lr)
        _local(self.params[i]).copy_(self.global_params[i])


    @torch.no_grad()
    def pseudo_gradients(self) -> list[torch.Tensor]:
        """``global - local`` of every parameter (this rank's shard): what a replica group
        contributes to an outer step that :mod:`ray_mesh.replicas` averages across groups."""
        return [g - _local(p).detach() for g, p in zip(self.global_params, self.params,
                                                        strict=True)]

    @torch.no_grad()
    def apply_average(self, averages: list[torch.Tensor]) -> None:
        """Take the outer step with pseudo-gradients averaged elsewhere (replica groups)."""
        for i, avg in enumerate(averages):
            self._outer_update(i, avg)
        self.outer_steps += 1

    def globals_equal(self) -> bool:
        """True when every replica holds bitwise the same global parameters (collective;
        with overlap the replicas' own parameters differ by the steps taken in flight)."""
        return tensors_equal(self.global_params, self.group)

    # ------------------------------------------------------------------ metrics
    def metrics(self) -> dict[str, float | int]:
        """Numbers to pass to ``ray_mesh.report`` (or any logger), all plain scalars:

        - ``diloco/inner_step``, ``diloco/outer_step``: counters (an outer step per fragment
          sync with streaming, counted when it lands);
        - ``diloco/in_flight``: syncs sent and not landed yet (overlap);
        - ``diloco/bytes_sent``: bytes this rank put on the cross-node link for all syncs so
          far (compressed size), ``diloco/bytes_per_outer_step`` their mean per outer step;
        - ``diloco/sync_s``: seconds this rank spent in syncs so far (forming and sending
          the pseudo-gradient, waiting for the average, the outer step): without overlap the
          time the link was busy as this rank saw it, with overlap only what the steps in
          flight did not hide; ``diloco/sync_s_per_outer_step`` their mean;
        - ``diloco/drift``: L2 norm of this rank's shard of ``global - local`` just before
          the last sync, i.e. how far the replica had moved in its H steps.
        """
        n = max(self.outer_steps, 1)
        return {
            "diloco/inner_step": self.inner_steps,
            "diloco/outer_step": self.outer_steps,
            "diloco/in_flight": len(self._in_flight),
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
        self.flush()
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

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("config", asdict(self.config)) != asdict(self.config):
            raise ParallelError(f"the checkpoint's DiLoCo settings {state['config']} differ "
                                f"from this run's {asdict(self.config)}; resume with the same "
                                "replicate: section")
        self.flush()
        for key, mine in (("global", self.global_params), ("momentum", self.momentum)):
            for dst, src in zip(mine, state[key], strict=True):
                dst.copy_(_local(src))
        self.inner_steps, self.outer_steps = (int(x) for x in state["counters"].tolist())


def replicas_equal(model: torch.nn.Module, group: dist.ProcessGroup) -> bool:
    """True when every replica holds bitwise the same parameters (for tests and checks)."""
    return tensors_equal([_local(p).detach() for p in model.parameters()], group)


def tensors_equal(tensors: Iterable[torch.Tensor], group: dist.ProcessGroup) -> bool:
    """True when every rank of ``group`` holds bitwise the same ``tensors`` (collective).

    Ranks compare a SHA-256 of their tensors' bytes (dtype and shape included), not the
    tensors: a check across a VPN then sends a few hundred bytes, where gathering the
    parameters would send the model and disturb the connections training uses.
    """
    digest = hashlib.sha256()
    for x in tensors:
        t = x.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{t.dtype}{tuple(x.shape)}".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes())
    everyone: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, digest.hexdigest(), group=group)
    return all(d == everyone[0] for d in everyone)


__all__ = ["DiLoCo"]
