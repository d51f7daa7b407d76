"""A heal and a full-tensor exchange at 125M, 1B and 8B parameters (issue 45):
``results.json["scale"]["exchange"]``.

What crosses replica groups goes through :mod:`ray_mesh.replicas.link`: a joining group
heals with :func:`~ray_mesh.replicas.link.send_state_`: a live group's state (parameters,
optimizer state, counters) sent to the healers only, and every boundary averages with
:func:`~ray_mesh.replicas.link.weighted_mean` (``compress: int8``:
:func:`~ray_mesh.replicas.link.compressed_weighted_mean`). Between groups of different
layouts (``exchange: full``) a heal goes through each group's rank 0, and so does the
average when a member group has a single rank; with every group of two ranks or more the
average is spread over them, rank ``i`` carrying slice ``i`` (:mod:`ray_mesh.replicas.reshard`,
measured for correctness in tests/dist/test_replica_layouts.py; the figures here are the
leaders' path: a lane's are the same functions on ``1/lanes`` of the payload).

Measured: those three functions on the real link (:class:`~ray_mesh.replicas.link.CrossLink`
over a store from :func:`~ray_mesh.replicas.link_store.serve_store`, signed), between
``members`` processes on this machine's loopback, at payloads of ``SIZES_MIB``; each
the median of ``REPEATS`` after one warm-up. Each path's time is fitted as ``fixed_s +
bytes * s_per_byte`` (least squares): the per-byte cost of the code path itself (flatten,
scale, reduce, copy back, gloo's copies) on this CPU.

Computed, not measured: for models of 125M, 1B and 8B parameters, the bytes each path moves
and its time on two links, this loopback (the fit alone) and the project's measured
WireGuard tunnel (``results_tunnel.json``: its median Mbit/s; the fit plus the bytes a
member sends over that rate). Bytes a member sends: a ring all-reduce sends ``2 (m - 1) /
m`` of the payload (``m`` members); a heal's donor sends the payload to each healer (one
here: a box that came back). The payloads:

* ``heal``: float32 parameters plus AdamW's two moments (12 bytes a parameter);
* ``heal_2donors``: the same heal from the two groups that hold the state, each sending
  about half (``state_sources``). ``tunnel_s`` counts the bytes a donor sends: the time
  where each box's uplink is the limit (a home line uploads slower than it downloads);
  ``tunnel_s_symmetric`` where the healer's downlink is as slow (the whole payload comes
  in whatever the donors), as on this project's tunnel between namespaces;
* ``exchange``: float32 gradients or pseudo-gradients (4 bytes a parameter);
* ``exchange_int8``: the same payload sent as int8 codes with a float32 scale per
  :data:`ray_mesh.parallel.compress.CHUNK` values, by all-gather (an int8 sum would
  overflow): each member sends its own codes to each other member;
* ``leader_bytes``: what rank 0 of a group holds for a full-tensor exchange (the full
  float32 tensor and its average: 8 bytes a parameter), whatever the group's size.

The machine's 1-minute load is recorded beside each size; a size measured at a load above
2 is published as None.

    python -m benchmarks.scale_exchange [--out FILE] [--sizes 1 4 16 64]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_quorum import MAX_LOAD, exponent, scale_main  # noqa: E402

SIZES_MIB = (1, 4, 16, 64)
MEMBERS = 3  # the lab's three groups
REPEATS = 3
PATHS = ("heal", "heal_2donors", "exchange", "exchange_int8")
MODELS = {"125M": 125e6, "1B": 1e9, "8B": 8e9}
BYTES_PER_PARAM = {"heal": 12, "exchange": 4}
TUNNEL = Path(__file__).resolve().parent / "results_tunnel.json"


def _member(index: int, members: int, address: tuple, sizes: tuple[int, ...],
            conn) -> None:  # noqa: ANN001 - a multiprocessing pipe
    """One member: for each size, time each path (warm-up, then ``REPEATS``); index 0
    sends its times back."""
    import torch

    from ray_mesh.replicas.link import (
        CrossLink,
        compressed_weighted_mean,
        send_state_,
        weighted_mean,
    )

    torch.set_num_threads(1)
    host, port, key = address
    link = CrossLink(host, port, inner_rank=0, timeout_s=120.0, key=key)
    pg = link.group(epoch=1, index=index, size=members)
    out: dict[int, dict[str, float]] = {}
    for mib in sizes:
        n = mib * 2**20 // 4
        # a few tensors of unequal size, as a model's are
        parts = [n // 2, n // 4, n - n // 2 - n // 4]
        tensors = [torch.randn(k) for k in parts]
        runs = {
            # one healer (the last member), as when one box comes back
            "heal": lambda t=tensors: send_state_(t, 0, [members - 1], pg, index),
            # the same from the two others at once, each sending a part (sync groups: every
            # entry equal on both)
            "heal_2donors": lambda t=tensors: send_state_(
                t, list(range(members - 1)), [members - 1], pg, index,
                shared=[True] * len(t)),
            "exchange": lambda t=tensors: weighted_mean(t, 1.0, pg),
            "exchange_int8": lambda t=tensors: compressed_weighted_mean(t, 1.0, pg, "int8"),
        }
        times: dict[str, float] = {}
        for name, fn in runs.items():
            fn()  # warm-up: buffers, the first collective's connections
            got = []
            for _ in range(REPEATS):
                pg.barrier().wait()  # every member starts together
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
            times[name] = statistics.median(got)
        out[mib] = times
    if index == 0:
        conn.send(out)
    link.forget()


def measure_paths(sizes: tuple[int, ...], members: int = MEMBERS) -> dict[int, dict]:
    """{MiB: {path: seconds}} on the real link between ``members`` processes here."""
    from ray_mesh.replicas.link_store import serve_store

    store, address = serve_store("127.0.0.1")
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [ctx.Process(target=_member, args=(i, members, address, sizes, child))
             for i in range(members)]
    for p in procs:
        p.start()
    try:
        if not parent.poll(600):
            raise TimeoutError("the exchange members did not report within 600 s")
        got = parent.recv()
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        del store
    return got


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per-unit) of ``y = fixed + x * per`` by least squares."""
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    per = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return max(0.0, my - per * mx), per


def wire_bytes(path: str, payload: float, members: int, healers: int = 1) -> float:
    """Bytes one member sends for ``path``: a heal's donor sends the payload to each
    healer (from two donors, half of it each); a ring all-reduce ``2 (m - 1) / m`` of it;
    int8's all-gather its codes and scales to each other member."""
    from ray_mesh.parallel.compress import CHUNK

    if path == "heal":
        return payload * healers
    if path == "heal_2donors":
        return payload * healers / 2
    if path == "exchange_int8":
        return payload / 4 * (1 + 4 / CHUNK) * (members - 1)
    return payload * 2 * (members - 1) / members


def tunnel_mbit() -> float | None:
    """The project's measured WireGuard tunnel, median Mbit/s (None if not measured)."""
    try:
        return float(json.loads(TUNNEL.read_text())["tunnel"]["median_mbit_s"])
    except (OSError, KeyError, ValueError):
        return None


def project(fits: dict[str, tuple[float, float]], members: int, mbit: float | None
            ) -> dict[str, dict]:
    """Bytes and seconds of each path at each model size: on this loopback (the fit) and
    on the tunnel (the fit plus the member's wire bytes at ``mbit``)."""
    out: dict[str, dict] = {}
    for model, params in MODELS.items():
        row: dict[str, object] = {"params": params, "leader_bytes": 8 * params}
        for path in PATHS:
            heal = path.startswith("heal")
            payload = params * BYTES_PER_PARAM["heal" if heal else "exchange"]
            fixed, per = fits[path]
            local = fixed + per * payload
            sent = wire_bytes(path, payload, members)
            row[path] = {"payload_bytes": payload, "sent_bytes": round(sent),
                         "loopback_s": round(local, 3),
                         "tunnel_s": (round(local + sent * 8 / (mbit * 1e6), 1)
                                      if mbit else None)}
            if heal:  # the healer takes in the whole payload whatever the donors
                row[path]["tunnel_s_symmetric"] = (
                    round(local + max(sent, payload) * 8 / (mbit * 1e6), 1) if mbit else None)
        out[model] = row
    return out


def measure(sizes: tuple[int, ...] = SIZES_MIB) -> dict:
    load = os.getloadavg()[0]
    got = measure_paths(sizes)
    after = os.getloadavg()[0]
    ok = max(load, after) <= MAX_LOAD
    rows = [{"payload_mib": mib, **{p: round(got[mib][p], 4) if ok else None for p in PATHS},
             "recorded": got[mib]} for mib in sizes]
    fits = {p: fit([(mib * 2**20, got[mib][p]) for mib in sizes]) for p in PATHS}
    for mib in sizes:
        print(f"{mib:4d} MiB: " + ", ".join(f"{p} {got[mib][p] * 1e3:.0f} ms" for p in PATHS),
              flush=True)
    mbit = tunnel_mbit()
    return {"sizes": rows, "load_1min": [round(load, 2), round(after, 2)],
            "members": MEMBERS,
            "fit": {p: {"fixed_s": round(f, 4), "ns_per_byte": round(b * 1e9, 3)}
                    for p, (f, b) in fits.items()},
            "models": project(fits, MEMBERS, mbit) if ok else None,
            "tunnel_mbit": mbit,
            # with the payload (1: linear in bytes), not with nodes
            "growth_exponent": {p: exponent(list(sizes), [got[m][p] for m in sizes])
                                for p in PATHS},
            "statistic": f"median of {REPEATS} after a warm-up, per size; models: computed "
                         "from the least-squares fit and the tunnel's median Mbit/s",
            "transport": "ray_mesh.replicas.link on gloo over loopback, signed store",
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "exchange", measure, SIZES_MIB)


if __name__ == "__main__":
    sys.exit(main())
