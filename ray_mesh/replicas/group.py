"""One replica group's side of a fault-tolerant ``dp_replicate`` dim, in its train function.

Each group is one ``dp_replicate`` index with its own inner mesh (``dp_shard`` x ``cp`` x
``tp`` on its node) and its own ``torch.distributed`` world; what crosses groups goes
through :mod:`.link`, and who takes part is decided by a :class:`~.quorum.Quorum` at every
boundary. A train function written for it::

    rg = ReplicaGroup(model, optim, client=..., group_id=..., total_steps=100)
    rg.commit()                        # join: heal from a live group, get samples
    while rg.running:
        ids = rg.sample_ids(dp_rank, dp_size)   # this rank's share of the group's samples
        loss_fn(model(data[ids])).backward()
        rg.commit()                    # average over the groups present, optimizer step
    rg.finish()

With ``diloco=`` the group runs inner steps on its own between commits (split the group's
samples with :meth:`ReplicaGroup.inner_batches`: ``every`` of them at an equal share, more
for a group the speed split gives more samples) and a commit is the outer step: the
pseudo-gradients are averaged, weighted by the samples each group processed.
Without DiLoCo, ``compress=`` sends each step's gradients between groups as ``bf16`` or
``int8`` (with error feedback: what rounding left out goes into the next step's
contribution) instead of float32: the link between boxes, a VPN, carries a quarter of
the bytes with ``int8``; with DiLoCo its config's ``compress`` applies.

``commit`` never gives up on a peer's failure: a failed collective is retried with the
groups that remain (the contribution is kept), and a group that was left behind or joins
receives the state of a live group first. Only this group's own failure (a rank of its own
died, or the quorum dropped it) raises, so that Ray Train replaces this group alone.

The batch of a step is the samples of the groups present, and the average is over those
samples: the gradient keeps its scale when a group is missing, the step just sees fewer
samples. ``lr_scaling="linear"`` also scales the learning rate by that fraction for the
step (the linear scaling rule); the default leaves it alone.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ray_mesh.checkpointing.sharded import broadcast_from_rank0
from ray_mesh.core.diloco_config import check_group_compress, check_group_diloco
from ray_mesh.errors import CheckpointError, GroupDropped
from ray_mesh.parallel.compress import CHUNK
from ray_mesh.replicas.coordinator import Coordinator, Decision, Range, meet_quorum
from ray_mesh.replicas.fallback import Fallback
from ray_mesh.replicas.link import (
    Abort,
    CrossLink,
    compressed_weighted_mean,
    send_state_,
    split_flat,
    weighted_mean,
)
from ray_mesh.replicas.reshard import (
    all_ranks_agree,
    check_exchange,
    full_like,
    lane_bounds,
    leader_outcome,
    locals_of,
    share_from_leader,
    share_lanes,
    to_full,
    to_local_,
)
from ray_mesh.replicas.shares import inner_steps
from ray_mesh.replicas.state import local_of, materialize, shared_entries, tensors_and_likes

if TYPE_CHECKING:
    from ray_mesh.core.diloco_config import DiLoCoConfig


LR_SCALING = ("none", "linear")
PHASES = ("meet_s", "wait_s", "exchange_s", "agree_s")  # a boundary's parts (metrics())


class ReplicaGroup:
    """This rank's handle on its replica group: :meth:`commit` at every boundary, while
    :attr:`running` the samples to train on from :meth:`sample_ids` (with DiLoCo,
    :meth:`inner_batches`), :meth:`finish` at the end. Under Ray,
    :func:`ray_mesh.replica_group` builds it (the module docstring has the whole loop).

    Stability: experimental
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                 client: Coordinator, group_id: int, total_steps: int,
                 segment_samples: int, diloco: DiLoCoConfig | None = None,
                 lr_scaling: str = "none", timeout_s: float = 30.0, beat_s: float = 0.5,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 0,
                 checkpoint_endpoint: str | None = None, checkpoint_keep: int | None = None,
                 upload_timeout_s: float = 600.0, exchange: str = "shards",
                 layout: str = "", compress: str = "none") -> None:
        if lr_scaling not in LR_SCALING:
            raise ValueError(f"lr_scaling={lr_scaling!r}: use one of {LR_SCALING}")
        check_group_compress(compress, diloco is not None)
        self.compress = compress
        check_exchange(exchange)
        self.exchange = exchange
        self.model, self.optimizer, self.client = model, optimizer, client
        self.gid, self.total_steps = group_id, total_steps
        self.segment_samples, self.lr_scaling = segment_samples, lr_scaling
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.size = dist.get_world_size() if dist.is_initialized() else 1
        self.incarnation = _shared_incarnation(self.rank)
        self.diloco = None
        if diloco is not None:
            check_group_diloco(diloco)
            from ray_mesh.parallel.diloco import DiLoCo

            self.diloco = DiLoCo(model, None, diloco)
        materialize(optimizer)
        self._counters = torch.zeros(3, dtype=torch.int64)  # step, inner, outer
        self.step = 0
        self.ranges: list[Range] = []
        self.done = False
        self.last: Decision | None = None
        # Its pace (shares.Pace): a boundary's own seconds (meeting the quorum, the exchange,
        # the step: not the wait for others) and the seconds of compute for its samples.
        self._since: float | None = None
        self._decided_at, self._fixed_s, self._meet_s = 0.0, None, 0.0
        # lane_bytes: what this rank's own slices of full-tensor exchanges came to (float32
        # bytes sent), spread over the group's ranks (_mean_over_lanes)
        self.stats: dict[str, float] = {"rejoin_bytes": 0, "heal_s": 0.0, "retries": 0,
                                        "live_groups": 0, "lane_bytes": 0}
        # Where a boundary's seconds go, summed since the last metrics(): meeting the quorum
        # (its own part), waiting there for the other groups, the exchange on the link with
        # the optimizer step, and the group's ranks agreeing on the outcome.
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._phase_commits = 0
        self._next_error: list[torch.Tensor] | None = None  # int8's left-over, until agreed
        self._sync_error: list[torch.Tensor] | None = None  # without DiLoCo: int8's held
        self._dropped = threading.Event()
        self._broken_epoch = 0  # from the beats: the newest epoch that lost a member
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat_loop, args=(beat_s,), daemon=True,
                                       name=f"ray_mesh-replica-beat-{group_id}")
        if self.rank == 0:
            client.register(group_id, self.incarnation, self.size, layout)
        _barrier()  # registered before any rank beats (an unknown group's beat is a drop)
        # Beating from here on: the coordinator's clock for this group runs from its
        # registration, and what follows (a bucket's client, the store's address) can take
        # seconds on a starved box -- time in which a silent group would count as gone.
        self._beats.start()
        try:
            # The run's fallback checkpoints (checkpoint_dir: a URI or a shared directory).
            self.fallback = Fallback(checkpoint_dir, client, group_id,
                                     every=checkpoint_every, endpoint=checkpoint_endpoint,
                                     keep=checkpoint_keep, upload_timeout_s=upload_timeout_s) \
                if checkpoint_dir and checkpoint_every else None
            host, port, key = client.store_address()  # key: signs the link's rendezvous
            self.link = CrossLink(host, port, self.rank, timeout_s, key=key)
        except BaseException:
            self._stop.set()  # a group that cannot start must not look alive
            raise

    # ------------------------------------------------------------------ the loop
    @property
    def running(self) -> bool:
        return not self.done and self.step < self.total_steps

    def sample_ids(self, dp_rank: int = 0, dp_size: int = 1) -> list[int]:
        """This rank's share of the group's samples for the current segment (contiguous
        slices of the group's list, by data-parallel rank inside the group)."""
        ids = [i for start, n in self.ranges for i in range(start, start + n)]
        per = self._per_rank(dp_size)
        return ids[dp_rank * per:(dp_rank + 1) * per]

    def _per_rank(self, dp_size: int) -> int:
        """The most samples a rank of the group holds this segment (the first ranks' share;
        the last may hold fewer)."""
        return -(-sum(n for _, n in self.ranges) // dp_size)

    def inner_batches(self, dp_rank: int = 0, dp_size: int = 1) -> list[list[int]]:
        """DiLoCo: this rank's samples for each inner step of the round. Each step takes the
        batch of an equal share (``segment_samples / every``), so a group that the speed
        split gives more samples takes more inner steps, not larger ones
        (:func:`~.shares.inner_steps`). Without DiLoCo: one batch, :meth:`sample_ids`."""
        ids = self.sample_ids(dp_rank, dp_size)
        if self.diloco is None:
            return [ids]
        return inner_steps(ids, self._per_rank(dp_size), self.segment_samples,
                           self.diloco.config.every, dp_size)

    def commit(self) -> bool:
        """Meet the other groups at this boundary: heal if behind, average the contributions
        of the groups present, take the (outer) optimizer step. True when a step was taken;
        False when there was nothing to average (the first call) or the run is done."""
        try:
            return self._commit()
        except BaseException:
            # This attempt is over (its own world broke, or it was dropped): drop its
            # cross-group link now, so the other groups' collectives on it fail at once
            # rather than when this process exits or the link times out.
            self.link.forget()
            raise

    def _commit(self) -> bool:
        fresh = False
        while True:
            if self._dropped.is_set():
                raise GroupDropped(f"replica group {self.gid}: the coordinator dropped this "
                                   "attempt (it stopped beating in time)")
            holding = self.ranges if self._has_contribution() else []
            called = time.monotonic()
            busy = None if self._since is None or fresh else called - self._since
            d = self._quorum(holding, fresh, busy, None if fresh else self._fixed_s)
            self._decided_at = time.monotonic()
            # Meeting the quorum costs this box its own time too (the call, the decision's
            # way to every rank): that is part of its cycle; waiting for the others is not.
            self._meet_s = max(0.0, self._decided_at - called - d.waited_s)
            self.last = d
            if d.done:
                self.done = True
                return False
            ok, applied = self._boundary(d)
            exchanged = time.monotonic()
            agreed = all_ranks_agree(ok)
            self._time_phases(d, exchanged)
            if agreed:
                self._after(d, applied)
                return applied
            self.link.forget()
            self.stats["retries"] += 1
            fresh = True

    def finish(self) -> None:
        """After the last step: tell the coordinator (the run is over for groups still
        joining) and stop the heartbeats."""
        if not self.done:
            self._quorum([], False)
            self.done = True
        if self.fallback is not None:  # the upload under way, bounded
            self.fallback.close()
        self._stop.set()

    # ------------------------------------------------------------------ inside a boundary
    def _has_contribution(self) -> bool:
        if self.diloco is not None:
            return bool(self.ranges)
        return bool(self.ranges) and any(p.grad is not None for p in self.model.parameters())

    def _quorum(self, holding: list[Range], fresh: bool, busy_s: float | None = None,
                fixed_s: float | None = None) -> Decision:
        return meet_quorum(self.client, self.rank == 0, lambda a: broadcast_from_rank0(a, None),
                           self.gid, self.incarnation, self.step, [tuple(r) for r in holding],
                           fresh, busy_s, fixed_s)

    def _boundary(self, d: Decision) -> tuple[bool, bool]:
        """Heal, average, apply; (this rank saw no error, an update was applied)."""
        if self.exchange == "full":
            return self._boundary_full(d)
        try:
            abort = self._abort(d)
            pg = self.link.group(d.epoch, d.index, len(d.members), abort)
            # Contributions first: a DiLoCo member's pseudo-gradient is of its own round,
            # and only healers take the donors' state (it is sent to them alone).
            mine = self._contribution()
            weight = float(sum(n for _, n in self.ranges)) if d.contributes else 0.0
            if d.restore is not None and d.index == d.donor:
                self._restore(d.restore[1])
            if d.moves_state:
                t0 = time.perf_counter()
                got = send_state_(self._state_and_likes()[0], d.sources, d.healers, pg,
                                  d.index, abort, self._shared())
                if d.heal:
                    self._adopt_counters()
                    self.stats["rejoin_bytes"] += got
                    self.stats["heal_s"] += time.perf_counter() - t0
                    self._drop_contribution()
            avg, total, own = self._average(mine, weight, pg, abort)
            self._hold_error(mine, own, weight)
        except RuntimeError as exc:  # a peer group died mid-collective, or a timeout
            self.stats["last_error"] = str(exc)[:300]
            return False, False
        if total <= 0:
            return True, False
        self._apply(avg, total)
        return True, True

    def _boundary_full(self, d: Decision) -> tuple[bool, bool]:
        """:meth:`_boundary` between groups of different layouts (:mod:`.reshard`): full
        tensors, the leaders (rank 0 of each group) across, each rank keeps its shard."""
        leader = self.rank == 0
        try:
            mine_local = self._contribution()
            likes = self._contribution_likes()
            mine = to_full(mine_local, likes)
            weight = float(sum(n for _, n in self.ranges)) if d.contributes else 0.0
            if d.restore is not None and d.index == d.donor:
                self._restore(d.restore[1])
            if d.moves_state:
                state, state_likes = self._state_and_likes()
                full = (to_full(state, state_likes) if d.index in d.sources
                        else [full_like(t, lk) for t, lk in zip(state, state_likes, strict=True)])
                t0, got = time.perf_counter(), 0
                shared = self._shared()
                ok, _ = self._on_link(leader, lambda pg, ab: send_state_(
                    full, d.sources, d.healers, pg, d.index, ab, shared), d)
                ok, _ = leader_outcome(ok, 0.0)
                if not ok:
                    return False, False
                if d.heal:
                    share_from_leader(full)
                    to_local_(state, full, state_likes)
                    got = sum(t.numel() * t.element_size() for t in full) if leader else 0
                    self._adopt_counters()
                    self.stats["rejoin_bytes"] += got
                    self.stats["heal_s"] += time.perf_counter() - t0
                    self._drop_contribution()
            got = (self._mean_over_lanes(mine, weight, d) if d.lanes > 1
                   else self._mean_by_leader(mine, weight, d))
            if got is None:
                return False, False
            total, avg, own = got
            if total <= 0:
                return True, False
            if own is not None:  # what compression left of each rank's own shard
                self._hold_error(mine_local, locals_of(own, likes, mine_local), weight)
            self._apply(locals_of(avg, likes, mine_local), total)
        except RuntimeError as exc:  # this group's own world broke: the MIN after says so
            self.stats["last_error"] = str(exc)[:300]
            return False, False
        return True, True

    def _mean_by_leader(self, mine: list[torch.Tensor], weight: float, d: Decision
                        ) -> tuple[float, list[torch.Tensor], list[torch.Tensor] | None] | None:
        """The members' weighted mean of the full tensors ``mine``, averaged by the leaders
        and shared from this group's: (total weight, mean, what this group's own contribution
        decoded to, with error feedback), the same on every rank; None if it failed."""
        leader = self.rank == 0
        ok, result = self._on_link(
            leader, lambda pg, ab: self._average(mine, weight, pg, ab), d)
        ok, total = leader_outcome(ok, result[1] if ok and leader else 0.0)
        if not ok:
            return None
        if total <= 0:
            return total, [], None
        avg = result[0] if leader else [torch.empty_like(m) for m in mine]
        share_from_leader(avg)
        own = None
        if self._error_feedback():
            own = result[2] if leader else [torch.empty_like(m) for m in mine]
            share_from_leader(own)
        return total, avg, own

    def _mean_over_lanes(self, mine: list[torch.Tensor], weight: float, d: Decision
                         ) -> tuple[float, list[torch.Tensor], list[torch.Tensor] | None] | None:
        """:meth:`_mean_by_leader` spread over ``d.lanes`` ranks (:mod:`.reshard`): rank
        ``i`` of every member averages slice ``i`` of the full tensors (one float32 buffer)
        on its own link, then this group's ranks share the slices."""
        flat = torch.cat([m.detach().reshape(-1).float().cpu() for m in mine])
        bounds = lane_bounds(flat.numel(), d.lanes,
                             CHUNK if self._compress_mode() == "int8" else 1)
        lo, hi = bounds[self.rank] if self.rank < d.lanes else (0, 0)
        ok, result = True, None
        if hi > lo:
            ok, result = self._on_link(
                True, lambda pg, ab: self._average([flat[lo:hi]], weight, pg, ab), d)
        if not all_ranks_agree(ok):
            return None
        self.stats["lane_bytes"] += 4 * (hi - lo)
        _, total = leader_outcome(True, result[1] if result is not None else 0.0)
        if total <= 0:
            return total, [], None
        avg, own = torch.zeros_like(flat), None
        if result is not None:
            avg[lo:hi] = result[0][0].cpu()
        avg = share_lanes(avg, bounds)
        if self._error_feedback():
            own = torch.zeros_like(flat)
            if result is not None:
                own[lo:hi] = result[2][0].cpu()
            own = split_flat(share_lanes(own, bounds), mine)
        return total, split_flat(avg, mine), own

    def _on_link(self, run: bool, step: Any, d: Decision) -> tuple[bool, Any]:
        """Run ``step(pg, abort)`` on this rank's link (its inner rank's: the leaders' for
        rank 0), if ``run``: (it worked, its result). A failure is kept, so the group hears
        of it (:func:`leader_outcome`, :func:`all_ranks_agree`)."""
        if not run:
            return True, None
        try:
            abort = self._abort(d)
            return True, step(self.link.group(d.epoch, d.index, len(d.members), abort), abort)
        except RuntimeError as exc:  # a peer group died mid-collective, or a timeout
            self.stats["last_error"] = str(exc)[:300]
            return False, None

    def _abort(self, d: Decision) -> Abort:
        """For the link's waits: True once the quorum dropped a member of ``d``'s epoch
        (its beats say so), or this attempt itself."""
        return lambda: self._broken_epoch >= d.epoch or self._dropped.is_set()

    def _contribution_likes(self) -> list[torch.Tensor | None]:
        params = self.diloco.params if self.diloco is not None else self.model.parameters()
        return list(params)

    def _contribution(self) -> list[torch.Tensor]:
        if self.diloco is not None:
            mine = self.diloco.pseudo_gradients()
        else:
            mine = [local_of(p.grad) if p.grad is not None else torch.zeros_like(local_of(p))
                    for p in self.model.parameters()]
        if self._error_feedback():  # last boundary's rounding left-over, sent now
            mine = [c + e for c, e in zip(mine, self._errors(mine), strict=True)]
        return mine

    def _drop_contribution(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        if self._error_feedback():  # a healed group's rounding left-over is of its old state
            for e in self._errors():
                e.zero_()
            self._next_error = None

    def _average(self, mine: list[torch.Tensor], weight: float, pg: Any, abort: Abort
                 ) -> tuple[list[torch.Tensor], float, list[torch.Tensor] | None]:
        """The weighted mean over the link, sent as ``compress`` (DiLoCo's, with DiLoCo)
        says, float32 uncompressed, and what this member's own contribution decoded to
        (None uncompressed)."""
        mode = self._compress_mode()
        if mode == "none":
            return (*weighted_mean(mine, weight, pg, abort), None)
        return compressed_weighted_mean(mine, weight, pg, mode, abort)

    def _compress_mode(self) -> str:
        """How contributions cross the link: DiLoCo's ``compress`` with DiLoCo, else the
        group's own."""
        return self.diloco.config.compress if self.diloco is not None else self.compress

    def _error_feedback(self) -> bool:
        if self.diloco is not None:
            return self.diloco.error is not None
        return self.compress == "int8"

    def _errors(self, likes: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The rounding left-over held for the next contribution: DiLoCo's own, or (sync)
        this group's, zeros until the first agreed int8 step."""
        if self.diloco is not None:
            return self.diloco.error
        if self._sync_error is None:
            likes = likes if likes is not None else self._contribution_likes()
            self._sync_error = [torch.zeros_like(local_of(x)) for x in likes]
        return self._sync_error

    def _hold_error(self, sent: list[torch.Tensor], own: list[torch.Tensor] | None,
                    weight: float) -> None:
        """Error feedback (int8; with DiLoCo, its ``error_feedback``): what rounding left
        out of ``sent`` goes into the next contribution, once this boundary is agreed on
        (:meth:`_after`); a member of weight 0 sent nothing of its own."""
        if self._error_feedback() and own is not None and weight > 0:
            self._next_error = [s - o for s, o in zip(sent, own, strict=True)]

    def _apply(self, avg: list[torch.Tensor], total: float) -> None:
        if self.diloco is not None:
            self.diloco.apply_average(avg)
            return
        scale = (total / (self.segment_samples * self._expected_groups())
                 if self.lr_scaling == "linear" else 1.0)
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * scale
        with torch.no_grad():
            for p, a in zip(self.model.parameters(), avg, strict=True):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_of(p.grad).copy_(a)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
            g["lr"] = lr

    def _time_phases(self, d: Decision, exchanged: float) -> None:
        now = time.monotonic()
        for name, secs in zip(PHASES, (self._meet_s, d.waited_s,
                                       exchanged - self._decided_at, now - exchanged),
                              strict=True):
            self._phases[name] += max(0.0, secs)
        self._phase_commits += 1

    def _expected_groups(self) -> int:
        return max(len(self.last.members) if self.last else 1, 1)

    def _after(self, d: Decision, applied: bool) -> None:
        if self._next_error is not None and applied:
            for e, new in zip(self._errors(self._next_error), self._next_error, strict=True):
                e.copy_(new)
        self._next_error = None
        self.step = d.step + (1 if applied else 0)
        self.ranges = list(d.ranges)
        self.stats["live_groups"] = len(d.members)
        self._since = time.monotonic()
        # A heal's transfer is a one-off, not this box's pace: not counted.
        self._fixed_s = (None if d.donor is not None
                         else self._since - self._decided_at + self._meet_s)
        if applied and d.index == 0 and self.fallback and self.fallback.due(self.step):
            self.fallback.save(self.step, *self._state_and_likes())  # uploads on its own

    # ------------------------------------------------------------------ state
    def _state_and_likes(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        dl = self.diloco
        self._counters[:] = torch.tensor([self.step, dl.inner_steps if dl else 0,
                                          dl.outer_steps if dl else 0])
        return tensors_and_likes(self.model, self.optimizer, dl, self._counters)

    def _shared(self) -> list[bool]:
        """Which entries of the state every holder of the newest step holds equal (a heal
        takes those from all of them at once, :func:`~.state.shared_entries`)."""
        return shared_entries(self.model, self.optimizer, self.diloco, self._counters)

    def _adopt_counters(self) -> None:
        step, inner, outer = (int(x) for x in self._counters)
        self.step = step
        if self.diloco is not None:
            self.diloco.inner_steps, self.diloco.outer_steps = inner, outer

    def _restore(self, path: str) -> None:
        if self.fallback is None:
            raise CheckpointError(f"replica group {self.gid} was asked to restore {path}, but "
                                  "has no checkpoint settings: give every group the same")
        self.fallback.restore(path, *self._state_and_likes())  # saved by global shape
        self._adopt_counters()
        self._drop_contribution()
        self.stats["restored_from"] = path

    def _beat_loop(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                broken = self.client.beat(self.gid, self.incarnation, self.rank)
            except Exception:  # noqa: BLE001 - the coordinator is busy: the next beat tells
                continue
            if broken is None:
                self._dropped.set()
                return
            self._broken_epoch = broken

    def metrics(self) -> dict[str, float]:
        """Plain scalars for ``ray_mesh.report``: ``replica_groups/live`` and friends, and
        the mean seconds per boundary of each of its phases since the last call
        (``replica_groups/meet_s``, ``wait_s``, ``exchange_s``, ``agree_s``: where a step's
        time beyond the compute goes)."""
        n = max(1, self._phase_commits)
        phases = {f"replica_groups/{k}": round(v / n, 4) for k, v in self._phases.items()}
        self._phases = dict.fromkeys(PHASES, 0.0)
        self._phase_commits = 0
        return {"replica_groups/live": self.stats["live_groups"],
                "replica_groups/step": self.step,
                "replica_groups/rejoin_bytes": self.stats["rejoin_bytes"],
                "replica_groups/retries": self.stats["retries"], **phases}


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _shared_incarnation(rank: int) -> str:
    """One id for this attempt of the group, the same on every rank (rank 0's)."""
    return str(broadcast_from_rank0(uuid.uuid4().hex[:12] if rank == 0 else None, None))


__all__ = ["ReplicaGroup"]
