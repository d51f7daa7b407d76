"""The time of one GPipe step: stages and the links between them as a flow shop.

Kept apart from :mod:`ray_mesh.planning.calibrate` (which measures what the stages and links
cost) because the schedule's shape is its own question: when a stage may start a
microbatch, and when a link may start carrying one.

A send does not start when the sender is ready. gloo's TCP transport moves a payload only
once the receiver has posted the matching recv (``Pair::send`` queues the buffer and sends
NOTIFY_SEND_READY; the bytes go when NOTIFY_RECV_READY comes back; NCCL is not measured
here). torch's ``ScheduleGPipe`` posts a stage's
recv for microbatch ``m`` just before it computes ``m``, after it finished ``m - 1``. So a
link whose receiving ranks move in lockstep (TP ranks, held together by their per-layer
collectives; or one rank per node) carries microbatch ``m`` only while the receiver is idle:
the link and the receiving stage take turns, ``send + compute`` per microbatch, not the
larger of the two. Where a node holds ``k`` pipelines side by side (pp with dp inside the
node), each still waits for its own receiver, but carries its microbatch alone while the
others compute, at ``k`` times the shared rate, and all of them together no faster than the
link: the step is the larger of the rendezvous schedule at ``send / k`` and the overlapped one
at ``send`` (``predict_calibrated``).

Measured (``benchmarks/rendezvous.py``: 20 Mbit/s, two ranks per node each sending 4 x 64 KiB
to its peer, the receivers computing c between recvs; median of 5, ms; send 54.6 per
microbatch): receivers in lockstep as TP's are, c = 20 / 50 / 100: 294 / 414 / 611 (take turns:
298 / 418 / 618; in parallel: 238 / 268 / 455); the same with every recv posted up front:
237 / 290 / 480 (in parallel); two independent receivers: 271 / 358 / 530 (side by side:
238 / 309 / 509). In slowlinks runs 14 and 15 pp's error at 100 Mbit/s was -1% / -18% priced
in parallel, +27% / +4% as one lockstep pipeline, +5% / -12% side by side.
"""

from __future__ import annotations

from ray_mesh.planning.cost import PlanError


def gpipe_s(fwd_s: float, bwd_s: float, link_s: float, microbatches: int, pp: int,
            rendezvous: bool = False) -> float:
    """Seconds of one GPipe step: ``pp`` stages in a line, a link between each two.

    Every microbatch goes forward through stage 0, link, stage 1, ... and, once a stage has
    run all its forwards (torch's ``ScheduleGPipe``), backward the other way. A stage runs
    one microbatch at a time, a link carries one at a time per direction, and each starts a
    microbatch as soon as it is free and the microbatch has arrived (a flow shop). With
    ``link_s = 0`` this is ``(microbatches + pp - 1) * (fwd_s + bwd_s)``, the bubble; a link
    slower than a stage becomes the pipeline's slowest stage instead of adding its time to
    every microbatch. ``rendezvous``: a link also waits until its receiving stage is done
    with the microbatch before (the receiver posts its recv then; module docstring), so the
    two take turns.
    """
    if microbatches < 1 or pp < 1 or min(fwd_s, bwd_s, link_s) < 0:
        raise PlanError(f"gpipe_s: microbatches={microbatches}, pp={pp} must be >= 1 and "
                        f"times (fwd {fwd_s}, bwd {bwd_s}, link {link_s}) >= 0")

    def line(stage_s: float) -> list[tuple[float, bool]]:
        """(duration, is a link) of every resource in a direction's order."""
        return [x for s in range(pp)
                for x in (((stage_s, False), (link_s, True)) if s < pp - 1 else
                          ((stage_s, False),))]

    def flow(resources: list[tuple[float, bool]], ready: list[float], start: float
             ) -> list[float]:
        """When each resource is done with its last microbatch; ready: when each is free
        to start, start: when the first resource may take microbatch 0."""
        free = list(ready)
        for _ in range(microbatches):
            t = start
            for r, (dur, is_link) in enumerate(resources):
                begin = max(free[r], t)
                if is_link and rendezvous:  # the receiver has posted this microbatch's recv
                    begin = max(begin, free[r + 1])
                t = free[r] = begin + dur
        return free

    forward = line(fwd_s)
    stage_free = flow(forward, [0.0] * len(forward), 0.0)[::2]  # each stage's last forward
    ready = [t for s in reversed(range(pp))
             for t in ((stage_free[s], 0.0) if s > 0 else (stage_free[s],))]
    return flow(line(bwd_s), ready, stage_free[-1])[-1]


def shared_core_efficiency(busy_s: float, alone_s: float, microbatches: int, pp: int) -> float:
    """A GPipe schedule's time over its ideal ``(microbatches + pp - 1) x busy`` when a
    stage runs at ``alone_s`` (per step of its shape) with only itself busy and ``busy_s``
    with every stage busy, linearly between. On devices of their own the two are equal
    (1.0); on shared cores the fill and drain run faster than the steady state.
    """
    if busy_s <= 0 or alone_s <= 0 or microbatches < 1 or pp < 2:
        raise PlanError(f"shared_core_efficiency: busy {busy_s}, alone {alone_s} must be > 0, "
                        f"microbatches={microbatches} >= 1, pp={pp} >= 2")
    slots = microbatches + pp - 1
    busy = [min(j + 1, pp, microbatches, slots - j) for j in range(slots)]
    total = sum(alone_s + (busy_s - alone_s) * (k - 1) / (pp - 1) for k in busy)
    return total / (slots * busy_s)


__all__ = ["gpipe_s", "shared_core_efficiency"]
