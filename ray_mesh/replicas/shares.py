"""How many samples each replica group gets per segment: equal, or by measured speed.

On unequal boxes (a faster GPU, more devices in one group, a node under load) equal
segments make every boundary wait for the slowest group. Split by speed, each group's
batch is sized so that all groups finish their segment at about the same time; the
averages weigh each contribution by its samples, so the update is still the mean over the
boundary's samples. Speed is what a group reports on arrival: the samples of its last
segment over the seconds since its last decision (a running mean, so one slow segment does
not swing the split). Those seconds include the previous boundary's own work (the exchange,
the optimizer step), which costs a slow box more than a fast one, and leave out only the
wait for the other groups at the quorum: with each share proportional to that speed, the
split settles where every group's whole cycle takes the same time. Pure functions: the
quorum calls them under its lock.
"""

from __future__ import annotations

SHARES = ("equal", "speed")
SPEED_SMOOTHING = 0.5  # weight of the newest segment in a group's running speed


def check_mode(mode: str) -> None:
    """Refuse a ``shares`` value that is not one of :data:`SHARES`, naming the choices."""
    if mode not in SHARES:
        raise ValueError(f"shares={mode!r}: use one of {SHARES} (\"speed\" sizes each "
                         "group's batch to its measured speed)")


def update_speed(speed: float | None, samples: int, busy_s: float | None) -> float | None:
    """A group's running speed (samples/s) after a segment of ``samples`` in ``busy_s``."""
    if not busy_s or busy_s <= 0 or samples <= 0:
        return speed
    now = samples / busy_s
    return now if speed is None else SPEED_SMOOTHING * now + (1 - SPEED_SMOOTHING) * speed


def split_samples(segment: int, groups: dict[int, tuple[int, float | None]],
                  mode: str = "equal") -> dict[int, int]:
    """Samples per group for the next segment. ``groups``: id -> (ranks, speed or None).

    ``"equal"``, or any group without a measured speed yet: ``segment`` each. ``"speed"``:
    the same total (``segment`` times the groups) in proportion to speed, in whole
    multiples of each group's rank count (its data-parallel ranks get equal batches), at
    least one sample per rank; what rounding leaves goes to the largest remainders, then to
    any group whose rank count still fits (2-rank groups next to a 1-rank one: no sample
    of the total is left over)."""
    check_mode(mode)
    if mode == "equal" or any(speed is None for _, speed in groups.values()):
        return {gid: segment for gid in groups}
    total = segment * len(groups)
    whole = sum(float(speed or 0.0) for _, speed in groups.values())
    out: dict[int, int] = {}
    rest: list[tuple[float, int]] = []
    for gid, (ranks, speed) in groups.items():
        exact = total * float(speed or 0.0) / whole / ranks  # in units of `ranks` samples
        out[gid] = max(1, int(exact)) * ranks
        rest.append((exact - int(exact), gid))
    left = total - sum(out.values())
    order = [gid for _, gid in sorted(rest, reverse=True)]
    while left > 0:  # largest remainders first; then whoever still fits (unequal rank counts)
        fits = [gid for gid in order if groups[gid][0] <= left]
        if not fits:
            break
        for gid in fits:
            if groups[gid][0] <= left:
                out[gid] += groups[gid][0]
                left -= groups[gid][0]
    return out


__all__ = ["SHARES", "SPEED_SMOOTHING", "check_mode", "split_samples", "update_speed"]
