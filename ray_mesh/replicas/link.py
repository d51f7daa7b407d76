"""The process groups that cross replica groups: one per inner rank, rebuilt per quorum epoch.

A replica group's own mesh (``dp_shard`` x ``cp`` x ``tp``) lives in its own
``torch.distributed`` world, which dies with the group. What crosses groups cannot live in
that world: when a group goes, the others must keep their mesh. So inner rank ``i`` of every
member group meets the others' inner rank ``i`` in a separate gloo process group, built
directly on a TCP store that outlives the groups (the coordinator hosts it), under a prefix
per epoch: a new member list is a new group, and an old one is never reused. Same-layout
groups pair shard with shard, so a collective moves exactly one copy of each shard. The store
listens on the coordinator node's address only, and gloo meets on it through a
:class:`~.link_store.SignedStore`: what a member reads there must carry the run's key, so a
host that reaches the port cannot join an epoch (:mod:`.link_store`).

Gloo, on CPU copies: this link is the slow one (the VPN between nodes), a dead peer shows up
as an error at once (its sockets close) instead of a hang, and ``timeout_s`` bounds the rest
(a peer that vanished without closing anything).

A member can also fail where no socket tells: after the quorum named it, before it built
the epoch's group (the others wait for it in the rendezvous), or with its node gone. The
quorum knows first (the group reported its error, or stopped beating), so every wait here
takes an ``abort`` check, asked every :data:`POLL_S`: once the epoch lost a member, the wait
ends with :class:`LinkAbandoned` at once instead of at ``timeout_s``. An abandoned group is
released on a thread of its own: gloo's destructor waits for the operation still queued.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ray_mesh.errors import LinkAbandoned
from ray_mesh.parallel.compress import start_average
from ray_mesh.replicas.flat import flat_by_dtype, scatter_back
from ray_mesh.replicas.link_store import SignedStore, parse_key

POLL_S = 0.2  # how often a wait on the link asks whether its epoch lost a member
Abort = Callable[[], bool]


class CrossLink:
    """Inner rank ``inner_rank``'s link to the same rank of the other member groups, over
    the coordinator's store at ``host:port``, signing with its ``key`` (hex:
    :func:`~.link_store.serve_store`)."""

    def __init__(self, host: str, port: int, inner_rank: int, timeout_s: float = 30.0, *,
                 key: str) -> None:
        self.host, self.port, self.inner_rank = host, port, inner_rank
        self.key = parse_key(key)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pg: dist.ProcessGroup | None = None
        self._epoch: int | None = None
        self.bytes_received = 0

    def group(self, epoch: int, index: int, size: int, abort: Abort | None = None
              ) -> dist.ProcessGroup | None:
        """This rank's process group for ``epoch`` (position ``index`` of ``size``
        members); None when it is the only member. Building it waits for every member;
        ``abort`` ends that wait (:class:`LinkAbandoned`) when one will not come."""
        if size < 2:
            self.forget()
            self._epoch = epoch
            return None
        if self._epoch != epoch or self._pg is None:
            self.forget()
            # A store client per epoch: a client is one connection whose requests queue, so
            # an abandoned rendezvous still blocked in it would hold up the next epoch's.
            store = dist.TCPStore(self.host, self.port, is_master=False, timeout=self.timeout)
            under = f"replicas/{epoch}/{self.inner_rank}/"
            prefix = SignedStore(dist.PrefixStore(under, store), under, self.key,
                                 f"{self.host}:{self.port}")
            self._pg = _build(lambda: dist.ProcessGroupGloo(prefix, index, size, self.timeout),
                              abort, epoch)
            self._epoch = epoch
        return self._pg

    def forget(self) -> None:
        """Drop the current group: its sockets close with it, so a peer still in a
        collective on it gets an error at once instead of waiting for ``timeout_s``. On a
        thread of its own: with an operation still queued (an abandoned wait) gloo's
        destructor blocks until that operation ends."""
        pg, self._pg, self._epoch = self._pg, None, None
        if pg is not None:
            t = threading.Thread(target=_release, args=(pg,), daemon=True,
                                 name="ray_mesh-link-release")
            del pg  # the thread's arguments hold the last reference
            t.start()


def _release(pg: Any) -> None:
    del pg


def _build(make: Callable[[], Any], abort: Abort | None, epoch: int) -> Any:
    """``make()`` (a gloo group's rendezvous) on a helper thread, so that ``abort`` can end
    the wait; an abandoned rendezvous ends on its own (its timeout) on that thread."""
    if abort is None:
        return make()
    return _on_thread(make, abort, "ray_mesh-link-rendezvous",
                      f"cross-group link of epoch {epoch}: a member left before it joined "
                      "the rendezvous (the quorum dropped it)")


def _on_thread(fn: Callable[[], Any], abort: Abort, name: str, abandoned: str) -> Any:
    """``fn()``'s result, run on a helper thread while this one asks ``abort`` every
    :data:`POLL_S`; once it says so, :class:`LinkAbandoned` (``abandoned``) and the thread is
    left to end with the group. ``fn``'s own error is raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True, name=name)
    t.start()
    while t.is_alive():
        t.join(POLL_S)
        if t.is_alive() and abort():
            box.clear()
            raise LinkAbandoned(abandoned)
    if "error" in box:
        raise box["error"]
    return box.pop("result")


def wait_all(works: Sequence[Any], abort: Abort | None = None) -> None:
    """Wait for ``works`` (gloo operations), asking ``abort`` every :data:`POLL_S`: an
    operation's own error is raised as is; an abort raises :class:`LinkAbandoned` and
    leaves the operation to end with its group (:meth:`CrossLink.forget`)."""
    poll = datetime.timedelta(seconds=POLL_S)
    for w in works:
        if abort is None:
            w.wait()
            continue
        while True:
            try:
                w.wait(poll)
                break
            except RuntimeError:
                if w.is_completed():  # it ended as the short wait gave up: its own outcome
                    w.wait()
                    break
                if abort():
                    raise LinkAbandoned("cross-group collective abandoned: a member of its "
                                        "epoch left (the quorum dropped it)") from None


def weighted_mean(tensors: Sequence[torch.Tensor], weight: float,
                  group: dist.ProcessGroup | None, abort: Abort | None = None
                  ) -> tuple[list[torch.Tensor], float]:
    """The mean of ``tensors`` over the group, each member weighted by ``weight`` (the
    samples behind its contribution; 0 for a member that contributes nothing), and the
    total weight. New tensors; the inputs are left as they were, so a failed collective
    leaves the caller's contribution intact for the retry. ``abort``: see :func:`wait_all`.

    Summed in the contributions' own precision (half precisions in float32): this is the
    collective on the VPN, whose bytes a step waits for, and a mean of a few weighted
    float32 terms needs no more (a float64 copy doubled the bytes for nothing)."""
    flats = flat_by_dtype(tensors)
    scaled = {dt: f.to(_summed_as(dt)) * weight if dt.is_floating_point else f
              for dt, f in flats.items()}
    total = torch.tensor([float(weight)], dtype=torch.float64)
    if group is not None:
        works = [dist.all_reduce(total, group=group, async_op=True)]
        works += [dist.all_reduce(f, group=group, async_op=True) for f in scaled.values()]
        wait_all(works, abort)
    w_all = float(total.item())
    out_flat = {dt: (f / w_all if w_all > 0 else f).to(dt) for dt, f in scaled.items()}
    results = [torch.empty_like(t, device="cpu") for t in tensors]
    scatter_back(results, out_flat)
    return [r.to(t.device) for r, t in zip(results, tensors, strict=True)], w_all


def compressed_weighted_mean(tensors: Sequence[torch.Tensor], weight: float,
                             group: dist.ProcessGroup | None, mode: str,
                             abort: Abort | None = None
                             ) -> tuple[list[torch.Tensor], float, list[torch.Tensor]]:
    """:func:`weighted_mean` with each member's weighted tensors sent compressed as ``mode``
    (``bf16`` or ``int8``: :mod:`ray_mesh.parallel.compress`, DiLoCo's ``compress``), and
    what this member's own tensors decode to after compression (for error feedback; the
    tensors themselves for a member alone or of weight 0). New tensors, float32 on the wire
    and back in each tensor's dtype and device."""
    if group is None:  # alone: nothing crosses, nothing is rounded
        return [t.detach().clone() for t in tensors], float(weight), \
            [t.detach().clone() for t in tensors]
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors])
    total = torch.tensor([float(weight)], dtype=torch.float64)
    pending = start_average(flat * weight, mode, group)
    wait_all([dist.all_reduce(total, group=group, async_op=True), *pending.works], abort)
    w_all = float(total.item())
    summed = pending.wait() * pending.n  # the mean of the weighted terms, times the members
    mean = summed / w_all if w_all > 0 else summed
    own = pending.own / weight if weight > 0 else flat
    return split_flat(mean, tensors), w_all, split_flat(own, tensors)


def split_flat(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``flat`` (float32, ``like`` concatenated) back as tensors shaped like ``like``, each
    in its own dtype and device."""
    out, offset = [], 0
    for t in like:  # views of ``flat`` where dtype and device match: no copy on the exchange
        n = t.numel()
        out.append(flat[offset:offset + n].view_as(t).to(dtype=t.dtype, device=t.device))
        offset += n
    return out


def _summed_as(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def state_sources(sizes: Sequence[int], shared: Sequence[bool], donors: int) -> list[int]:
    """Which of ``donors`` sends each entry of a heal (by position in the donor list): an
    entry not ``shared`` (equal on every donor) from the first, whole; the shared ones
    whole too, largest first, each to the donor with the fewest bytes so far (ties: the
    lowest). The same on every member, from the sizes alone. Each donor's link then carries
    about ``1/donors`` of the state: on boxes whose uplink is slower than their downlink (a
    home line), a heal from k live groups takes about 1/k of the time."""
    part = [0] * len(sizes)
    own = sum(n for n, sh in zip(sizes, shared, strict=True) if not sh)  # the first's
    if donors <= 1:
        return part
    load = [own] + [0] * (donors - 1)
    for i in sorted((i for i, sh in enumerate(shared) if sh), key=lambda i: (-sizes[i], i)):
        j = min(range(donors), key=lambda k: (load[k], k))
        part[i], load[j] = j, load[j] + sizes[i]
    return part


def send_state_(tensors: Sequence[torch.Tensor], src: int | Sequence[int],
                healers: Sequence[int], group: dist.ProcessGroup | None, me: int,
                abort: Abort | None = None, shared: Sequence[bool] | None = None) -> int:
    """The donors' ``tensors`` to the ``healers`` only, point to point, written in place on
    each healer; returns the bytes that came in (0 on a donor and on the members that need
    nothing). ``src``: one donor, or every member holding the state (the first one first),
    each sending its part (:func:`state_sources`; ``shared`` says which entries are equal on
    all of them, none by default). The other members already hold this state, so nothing
    goes to them: a broadcast sent them a copy to drop, one more payload through the
    donor's link per member (``benchmarks/scale_exchange.py``)."""
    srcs = [src] if isinstance(src, int) else list(src)
    if group is None or not healers or not srcs or (me not in srcs and me not in healers):
        return 0
    part = state_sources([t.numel() * t.element_size() for t in tensors],
                         [False] * len(tensors) if shared is None else shared, len(srcs))
    works: list[Any] = []
    received: list[tuple[list[torch.Tensor], dict[torch.dtype, torch.Tensor]]] = []
    for j, s in enumerate(srcs):
        if me != s and me not in healers:
            continue
        mine = [t for t, k in zip(tensors, part, strict=True) if k == j]
        if not mine:
            continue
        flats = flat_by_dtype(mine)  # its dtypes in the same order on every member
        if me == s:
            works += [group.send([f], h, tag) for h in healers
                      for tag, f in enumerate(flats.values())]
        else:
            works += [group.recv([f], s, tag) for tag, f in enumerate(flats.values())]
            received.append((mine, flats))
    _wait_p2p(works, abort)
    for mine, flats in received:
        scatter_back(mine, flats)
    return sum(f.numel() * f.element_size() for _, flats in received for f in flats.values())


def _wait_p2p(works: Sequence[Any], abort: Abort | None) -> None:
    """Wait for gloo sends and receives, asking ``abort`` every :data:`POLL_S`. Not by
    :func:`wait_all`'s short waits: a gloo send or receive whose wait times out ends there
    for good (it raises, and the transfer is abandoned), where a collective goes on. So each
    waits without a bound on a helper thread, and an abort leaves that thread to end with
    the group (:meth:`CrossLink.forget`)."""
    def wait() -> None:
        for w in works:
            w.wait()

    if abort is None:
        wait()
        return
    _on_thread(wait, abort, "ray_mesh-link-p2p", "cross-group transfer abandoned: a member "
               "of its epoch left (the quorum dropped it)")
