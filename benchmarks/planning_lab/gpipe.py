"""The time of one GPipe step: stages and the links between them as a flow shop.

Kept apart from :mod:`benchmarks.planning_lab.calibrate` (which measures what the stages and links
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

Op = tuple[str, int, int]  # (kind, stage, microbatch): f/b compute, xf/xb a link's carry


def _ops(pp: int, microbatches: int) -> dict[tuple[str, int], list[Op]]:
    """Every resource's operations in the order it runs them: stage ``s`` all forwards then
    all backwards (ScheduleGPipe), the link after stage ``s`` one microbatch at a time per
    direction."""
    seq: dict[tuple[str, int], list[Op]] = {}
    for s in range(pp):
        seq[("stage", s)] = ([("f", s, m) for m in range(microbatches)]
                             + [("b", s, m) for m in range(microbatches)])
    for s in range(pp - 1):
        seq[("fwd link", s)] = [("xf", s, m) for m in range(microbatches)]
        seq[("bwd link", s)] = [("xb", s, m) for m in range(microbatches)]
    return seq


def _needs(op: Op, pp: int, microbatches: int, rendezvous: bool) -> list[Op]:
    """What must be done before ``op`` starts (besides its resource's previous op)."""
    kind, s, m = op
    if kind == "f":
        return [("xf", s - 1, m)] if s > 0 else []
    if kind == "b":
        return [("xb", s, m)] if s < pp - 1 else []
    if kind == "xf":  # stage s -> s + 1; the receiver posts recv m after its forward m - 1
        return [("f", s, m)] + ([("f", s + 1, m - 1)] if rendezvous and m else [])
    # "xb": stage s + 1 -> s; the receiver posts recv m after its previous op
    return [("b", s + 1, m)] + ([("b", s, m - 1) if m else ("f", s, microbatches - 1)]
                                if rendezvous else [])


def gpipe_s(fwd_s: float, bwd_s: float, link_s: float, microbatches: int, pp: int,
            rendezvous: bool = False, alone: float = 1.0) -> float:
    """Seconds of one GPipe step: ``pp`` stages in a line, a link between each two.

    Every microbatch goes forward through stage 0, link, stage 1, ... and, once a stage has
    run all its forwards (torch's ``ScheduleGPipe``), backward the other way. A stage runs
    one microbatch at a time, a link carries one at a time per direction, and each starts a
    microbatch as soon as it is free and the microbatch has arrived. With ``link_s = 0`` and
    ``alone = 1`` this is ``(microbatches + pp - 1) * (fwd_s + bwd_s)``, the bubble; a link
    slower than a stage becomes the pipeline's slowest stage instead of adding its time to
    every microbatch. ``rendezvous``: a link also waits until its receiving stage is done
    with the op before (the receiver posts its recv then; module docstring), so the two
    take turns.

    ``fwd_s``/``bwd_s`` are a stage's times with every stage computing; ``alone`` is the
    time with only one computing, as a fraction of that (stages sharing cores: one alone
    runs faster; 1 on devices of their own), linear in between. The schedule is simulated
    event by event, so a stage computing while the others wait on a link runs at its
    alone speed: the fill and drain of the bubble, and a slow link's turns.
    """
    if microbatches < 1 or pp < 1 or min(fwd_s, bwd_s, link_s) < 0 or not 0 < alone <= 1:
        raise PlanError(f"gpipe_s: microbatches={microbatches}, pp={pp} must be >= 1, times "
                        f"(fwd {fwd_s}, bwd {bwd_s}, link {link_s}) >= 0 and alone={alone} "
                        "in (0, 1]")
    seq = _ops(pp, microbatches)
    work = {"f": fwd_s, "b": bwd_s, "xf": link_s, "xb": link_s}
    done: set[Op] = set()
    nxt = dict.fromkeys(seq, 0)
    running: dict[tuple[str, int], list] = {}  # resource -> [op, work left]
    t = 0.0
    while True:
        for res, ops in seq.items():
            if res not in running and nxt[res] < len(ops):
                op = ops[nxt[res]]
                if all(d in done for d in _needs(op, pp, microbatches, rendezvous)):
                    running[res] = [op, work[op[0]]]
        if not running:
            return t
        busy = sum(res[0] == "stage" for res in running)
        pace = 1.0 if pp == 1 else 1.0 / (alone + (1 - alone) * max(busy - 1, 0) / (pp - 1))
        rate = {res: pace if res[0] == "stage" else 1.0 for res in running}
        step = min(left / rate[res] for res, (_, left) in running.items())
        t += step
        for res in list(running):
            running[res][1] -= step * rate[res]
            if running[res][1] <= 1e-12:
                done.add(running.pop(res)[0])
                nxt[res] += 1


__all__ = ["gpipe_s"]
