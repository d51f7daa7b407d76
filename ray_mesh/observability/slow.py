"""The slow rank and the slow link, named: analysis of per-rank waits (Ray-free, torch-free).

Input: per rank, one window of :mod:`ray_mesh.observability.waits` (seconds waiting in each
mesh dim's collectives, the rest "compute") with the rank's node and mesh coordinates, and
the link matrix measured at bring-up (:mod:`ray_mesh.network.links`). Output: per dim the
slowest rank, per node pair the link's Mbit/s, and one verdict line (or none when healthy).

How the culprits show in the numbers:

* **A straggler waits least.** In a collective the slow rank arrives last: its peers sit in
  the collective waiting for it, it does not. Its lateness spreads to every rank through the
  next collectives, so the straggler is the rank whose *total* wait share is far below the
  others' (:data:`STRAGGLER_GAP`, :data:`STRAGGLER_RATIO`). Per dim, the slowest rank is the
  one that waits least in that dim and in all (the score is the sum of both shares: in a
  dim a straggler's group peers may wait little there because they waited on it earlier).
* **A slow link keeps everyone waiting in the dims that cross it.** All ranks' shares in a
  cross-node dim are high (:data:`LINK_WAIT`) with no rank far below the others; the link
  matrix then says which link: the node whose links are all slow (three or more nodes,
  :meth:`LinkMatrix.slow_nodes`), else the slowest link compared with the others, or with
  the within-node rate when there is only one pair.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ray_mesh.core.safe import safe_text
from ray_mesh.core.spec import DIM_NAMES, FLATTENED_DIMS
from ray_mesh.network.links import LinkMatrix

STRAGGLER_GAP = 0.15  # the others wait this share of the time more than the straggler ...
STRAGGLER_RATIO = 2.0  # ... and at least this many times as long
LINK_WAIT = 0.25  # a cross-node dim where ranks wait this share of the time: a slow link
MIN_WINDOW_S = 1.0  # shorter windows are too few samples to judge
LINK_LINES = 12  # links listed by format_analysis, the slowest first; the rest are counted


@dataclass(frozen=True)
class RankTimes:
    """One rank's last window: where its time went."""

    rank: int
    node: str
    coord: dict[str, int]
    window_s: float
    wait_s: dict[str, float]
    compute_s: float

    def share(self, dim: str) -> float:
        return self.wait_s.get(dim, 0.0) / self.window_s

    @property
    def wait_share(self) -> float:
        """Share of the window in any collective."""
        return max(0.0, 1.0 - self.compute_s / self.window_s)


@dataclass
class DimFinding:
    """The slowest rank of one dim, and how long the ranks wait in it."""

    dim: str
    slowest_rank: int
    node: str
    wait_share: float  # the slowest rank's
    peers_wait_share: float  # the median of the other ranks'
    crosses_nodes: bool


@dataclass
class Analysis:
    dims: dict[str, DimFinding] = field(default_factory=dict)
    links: list[dict[str, Any]] = field(default_factory=list)
    verdict: str | None = None
    straggler: int | None = None
    slow_link: tuple[str, str] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"dims": {d: asdict(f) for d, f in self.dims.items()}, "links": self.links,
                "verdict": self.verdict, "straggler": self.straggler,
                "slow_link": list(self.slow_link) if self.slow_link else None}


def dim_parts(dim: str) -> tuple[str, ...]:
    """The mesh dims a label spans ('world' spans all)."""
    if dim == "world":
        return DIM_NAMES
    return FLATTENED_DIMS.get(dim, (dim,))


def groups_of(ranks: Sequence[RankTimes], dim: str) -> list[list[RankTimes]]:
    """The ranks of each group of ``dim``: equal coordinates outside the dim."""
    parts = dim_parts(dim)
    out: dict[tuple, list[RankTimes]] = {}
    for r in ranks:
        key = tuple(r.coord.get(d, 0) for d in DIM_NAMES if d not in parts)
        out.setdefault(key, []).append(r)
    return list(out.values())


def crosses_nodes(ranks: Sequence[RankTimes], dim: str) -> bool:
    return any(len({r.node for r in g}) > 1 for g in groups_of(ranks, dim))


def _median(values: Iterable[float]) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def analyze(ranks: Sequence[RankTimes], links: LinkMatrix | None = None) -> Analysis:
    """Per dim the slowest rank, the links, and the verdict (None: nothing slow)."""
    out = Analysis(links=links.to_json() if links else [])
    ranks = [r for r in ranks if r.window_s >= MIN_WINDOW_S]
    if len(ranks) < 2:
        return out
    dims = sorted({d for r in ranks for d in r.wait_s},
                  key=lambda d: ((*DIM_NAMES, *FLATTENED_DIMS, "world") + (d,)).index(d))
    for dim in dims:
        slowest = min(ranks, key=lambda r: (r.share(dim) + r.wait_share, r.rank))
        out.dims[dim] = DimFinding(
            dim=dim, slowest_rank=slowest.rank, node=slowest.node,
            wait_share=slowest.share(dim),
            peers_wait_share=_median(r.share(dim) for r in ranks if r is not slowest),
            crosses_nodes=crosses_nodes(ranks, dim))
    out.verdict = _straggler(ranks, out) or _slow_link(ranks, out, links)
    return out


def _straggler(ranks: Sequence[RankTimes], out: Analysis) -> str | None:
    slow = min(ranks, key=lambda r: (r.wait_share, r.rank))
    others = [r for r in ranks if r is not slow]
    peers = _median(r.wait_share for r in others)
    if peers - slow.wait_share < STRAGGLER_GAP or peers < STRAGGLER_RATIO * slow.wait_share:
        return None
    out.straggler = slow.rank
    # The dim its peers wait in most: where the lateness shows first.
    dim = max(out.dims, key=lambda d: _median(r.share(d) for r in others), default="?")
    compute = _median(r.compute_s / r.window_s for r in others)
    mine = slow.compute_s / slow.window_s
    ratio = f", {mine / compute:.1f}x the others' compute share" if compute > 0 else ""
    return (f"slow rank {slow.rank} (node {slow.node}): the other ranks wait {_pct(peers)} of "
            f"the time in collectives (most in {dim}), rank {slow.rank} {_pct(slow.wait_share)}"
            f"{ratio}")


def _slow_link(ranks: Sequence[RankTimes], out: Analysis,
               links: LinkMatrix | None) -> str | None:
    cross = {d: _median(r.share(d) for r in ranks) for d, f in out.dims.items()
             if f.crosses_nodes and d != "world"}
    if not cross:
        return None
    dim = max(cross, key=cross.__getitem__)
    if cross[dim] < LINK_WAIT:
        return None
    waits = f"{dim} collectives hold every rank {_pct(cross[dim])} of the time"
    if links is None or not links.cross():
        return f"{waits}; the node links were not measured (MeshConfig(measure_links=True))"
    slow_nodes = links.slow_nodes()
    if slow_nodes:
        node = slow_nodes[0]
        mine = [x for x in links.cross() if node in (x.a, x.b)]
        worst = min(mine, key=lambda x: x.mbit_s)
        others = _median(x.mbit_s for x in links.cross() if node not in (x.a, x.b))
        out.slow_link = (worst.a, worst.b)
        return (f"node {node}: {dim} {others / max(worst.mbit_s, 1e-9):.1f}x slower than the "
                f"other links, {worst.mbit_s:.0f} Mbit/s ({others:.0f} elsewhere); {waits}")
    worst = min(links.cross(), key=lambda x: x.mbit_s)
    rest = [x.mbit_s for x in links.cross() if x is not worst]
    within = [x.mbit_s for x in links.links if x.a == x.b]
    base, what = (_median(rest), "the other links") if rest else (_median(within),
                                                                  "within a node")
    a, b = sorted((worst.a, worst.b))  # one spelling whichever node measured the pair
    out.slow_link = (a, b)
    ratio = f", {base / max(worst.mbit_s, 1e-9):.1f}x slower than {what} ({base:.0f})" \
        if base else ""
    return f"link {a} <-> {b}: {worst.mbit_s:.0f} Mbit/s{ratio}; {waits}"


# ----------------------------------------------------------------------------- from status rows
def times_from_row(row: dict[str, Any]) -> RankTimes | None:
    """A :class:`RankTimes` from a ``ray-mesh status`` rank row (None: no window yet)."""
    window = row.get("window_s")
    if not window or "compute_s" not in row:
        return None
    coord = {}
    for d in DIM_NAMES:
        try:
            coord[d] = int(row.get(d, 0) or 0)
        except (TypeError, ValueError):
            coord[d] = 0
    waits = {k.split("/", 1)[1]: float(v) for k, v in row.items()
             if k.startswith("wait_s/")}
    return RankTimes(rank=int(row["rank"]), node=str(row.get("node_ip") or row.get("node")),
                     coord=coord, window_s=float(window), wait_s=waits,
                     compute_s=float(row["compute_s"]))


def links_from_samples(samples: Sequence[tuple[str, dict, float]], run: str
                       ) -> LinkMatrix | None:
    """The link matrix a run's rank 0 exports (``ray_mesh_link_mbit{a, b}``)."""
    found = {(lab["a"], lab["b"]): v for name, lab, v in samples
             if name == "ray_mesh_link_mbit" and lab.get("run") == run and "a" in lab}
    if not found:
        return None
    return LinkMatrix.from_json([{"a": a, "b": b, "mbit_s": v} for (a, b), v in found.items()])


def analyze_run(rows: Sequence[dict[str, Any]], samples: Sequence[tuple[str, dict, float]],
                run: str) -> Analysis:
    """:func:`analyze` on a status run's rank rows and the scraped samples."""
    times = [t for t in (times_from_row(r) for r in rows) if t is not None]
    return analyze(times, links_from_samples(samples, run))


def format_analysis(a: dict[str, Any]) -> list[str]:
    """Text lines for ``ray-mesh status`` from :meth:`Analysis.to_json`."""
    lines = []
    for f in a["dims"].values():
        where = "crosses nodes" if f["crosses_nodes"] else "within nodes"
        lines.append(f"  {f['dim']:<13} slowest rank {f['slowest_rank']} (node {f['node']}, "
                     f"waits {_pct(f['wait_share'])}; the others "
                     f"{_pct(f['peers_wait_share'])}) [{where}]")
    cross = [x for x in a["links"] if x["a"] != x["b"]]
    if len(cross) > LINK_LINES:  # hundreds of nodes: the slowest, then how many more
        cross.sort(key=lambda x: x["mbit_s"])
    for x in cross[:LINK_LINES]:
        lines.append(f"  link {x['a']} <-> {x['b']}: {x['mbit_s']:.0f} Mbit/s")
    if len(cross) > LINK_LINES:
        lines.append(f"  ... {len(cross) - LINK_LINES} more link(s), up to "
                     f"{cross[-1]['mbit_s']:.0f} Mbit/s")
    if not a["dims"]:
        lines.append("  (no wait windows yet: they appear ~10-20 s after training starts)")
    lines.append(f"  verdict: {a['verdict'] or 'no slow rank or link'}")
    return [safe_text(line) for line in lines]  # node names and links come from the ranks
