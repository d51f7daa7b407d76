"""A picture of the mesh: ``ray-mesh status --html FILE`` as one self-contained HTML page.

Rendered from what :func:`ray_mesh.status.cluster.collect` gathered (a
:class:`ClusterStatus`), Ray-free and without JavaScript: every drawing is inline SVG built
here, so the file opens offline, from a mail attachment or a CI artifact, with no CDN. It shows

* every node as a box holding its ranks; each rank cell gives the rank's mesh coordinate
  (the dims of size > 1), its device and its latest step time, coloured against the run's
  median (green: within 10 %, amber: within 50 %, red: slower; grey: no metrics yet);
* links between nodes, labelled with measured bandwidth when given (``links``: a list of
  ``{"a": node, "b": node, "mbit_s": number}``, nodes by IP or id);
* loss and throughput curves per run. Status is a snapshot, so the history comes from the
  page itself: the data of every render is embedded as JSON, and rendering into an existing
  file appends the current point (``watch -n 15 ray-mesh status --html mesh.html`` draws
  the curves as the run goes), or pass ``history`` directly.
"""

from __future__ import annotations

import html
import json
import re
import statistics
import time
from pathlib import Path
from typing import Any

from ray_mesh.core.safe import safe_text
from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.status.cluster import ClusterStatus

DATA_ID = "ray-mesh-data"
HISTORY_MAX = 500  # points kept per run
SHORT = {"pp": "pp", "dp_replicate": "rep", "dp_shard": "shard", "cp": "cp", "tp": "tp"}
COLOURS = {"ok": "#2e9d5b", "slow": "#e0a526", "bad": "#d64545", "none": "#b8bec6"}
CELL_W, CELL_H, GAP, PAD, HEAD = 132, 58, 10, 14, 52
MAX_ARCS = 24  # links between nodes that are not side by side, drawn (the first given)
CSS = """
body{font:14px/1.4 system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#1d2733;
background:#f5f7fa}h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.meta{color:#5b6878}.card{background:#fff;border-radius:10px;padding:16px;margin:12px 0;
box-shadow:0 1px 3px rgba(0,0,0,.12)}.curves{display:flex;gap:16px;flex-wrap:wrap}
.legend span{display:inline-block;margin-right:14px}.legend i{display:inline-block;width:11px;
height:11px;border-radius:3px;margin-right:5px;vertical-align:-1px}
svg text{font-family:system-ui,sans-serif}.note{color:#8a5a00}h2+.meta{margin:-4px 0 10px}
.card h2{margin-top:0}.groups td,.groups th{padding:2px 10px;text-align:left}
.groups .bar{display:inline-block;height:10px;background:#2f6fd0;border-radius:2px}
"""


def _e(value: Any) -> str:
    """HTML-escaped, control characters shown as escapes: names come from the cluster."""
    return html.escape(safe_text(value), quote=True)


def _num(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if out == out else None  # NaN -> None


def _fmt(value: float) -> str:
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.3g}"


# ----------------------------------------------------------------------------- mesh
def step_colour(step_s: float | None, median: float | None) -> str:
    """Green within 10 % of the run's median step time, amber within 50 %, red beyond."""
    if step_s is None or not median:
        return COLOURS["none"]
    ratio = step_s / median
    return COLOURS["ok"] if ratio <= 1.10 else COLOURS["slow"] if ratio <= 1.50 \
        else COLOURS["bad"]


def _coord(row: dict[str, Any], sizes: dict[str, int]) -> str:
    dims = [d for d in DIM_NAMES if sizes.get(d, 1) > 1] or ["dp_shard"]
    return " ".join(f"{SHORT[d]}{row.get(d, '?')}" for d in dims)


def _node_key(row: dict[str, Any]) -> str:
    return str(row.get("node_ip") or row.get("node") or "?")


def _group_nodes(status: ClusterStatus, ranks: list[dict[str, Any]]
                 ) -> list[tuple[str, str, str, list[dict[str, Any]]]]:
    """[(key, title, detail, ranks)] for every node: the cluster's, then any only the ranks name."""
    by_node: dict[str, list[dict[str, Any]]] = {}
    for row in sorted(ranks, key=lambda r: int(r.get("rank", 0))):
        by_node.setdefault(_node_key(row), []).append(row)
    out = []
    for n in status.nodes:
        key = str(n.get("ip"))
        gpus = f" · {n['GPU']:g} GPU" if n.get("GPU") else ""
        title = f"{key}{' (head)' if n.get('head') else ''}"
        count = len(by_node.get(key, []))
        detail = f"{n.get('state', '')} · {n.get('CPU', 0):g} CPU{gpus} · {count} rank(s)"
        out.append((key, title, detail, by_node.pop(key, [])))
    out += [(key, key, f"{len(rows)} rank(s)", rows) for key, rows in by_node.items()]
    return out


def mesh_svg(status: ClusterStatus, run: dict[str, Any] | None,
             links: list[dict[str, Any]] | None = None) -> str:
    """Nodes as boxes, ranks as coloured cells, links with their bandwidth."""
    ranks = list(run["ranks"]) if run else []
    sizes = {d: len({r.get(d) for r in ranks}) for d in DIM_NAMES}
    steps = [s for s in (_num(r.get("step_s")) for r in ranks) if s]
    median = statistics.median(steps) if steps else None
    nodes = _group_nodes(status, ranks)
    cols = max([2] + [min(4, len(rows)) for *_, rows in nodes])
    box_w = cols * CELL_W + (cols - 1) * GAP + 2 * PAD
    rows_of = [max(1, -(-len(rows) // cols)) for *_, rows in nodes]
    box_h = [HEAD + r * CELL_H + (r - 1) * GAP + PAD for r in rows_of]
    link_gap = 120 if links else 40
    width = len(nodes) * box_w + (len(nodes) - 1) * link_gap + 20 if nodes else 400
    index = {k: i for i, (k, *_) in enumerate(nodes)}
    ids = {str(n.get("node_id")): str(n.get("ip")) for n in status.nodes}
    far = any(_far(link, index, ids) for link in links or [])
    height = (max(box_h) if box_h else 80) + (110 if far else 20)
    pos: dict[str, tuple[float, float]] = {}
    parts = []
    for i, (key, title, detail, rows) in enumerate(nodes):
        x, y = 10 + i * (box_w + link_gap), 10
        pos[key] = (x, y)
        parts.append(f'<g class="node" data-node="{_e(key)}"><rect x="{x}" y="{y}" '
                     f'width="{box_w}" height="{box_h[i]}" rx="12" fill="#eef2f7" '
                     f'stroke="#8796a8" stroke-width="1.5"/><text x="{x + PAD}" y="{y + 25}" '
                     f'font-size="14" font-weight="600" fill="#1d2733">node {_e(title)}</text>'
                     f'<text x="{x + PAD}" y="{y + 42}" font-size="12" fill="#5b6878">'
                     f'{_e(detail)}</text>')
        for j, row in enumerate(rows):
            cx = x + PAD + (j % cols) * (CELL_W + GAP)
            cy = y + HEAD + (j // cols) * (CELL_H + GAP)
            step_s = _num(row.get("step_s"))
            colour = step_colour(step_s, median)
            timing = f"{step_s * 1000:.0f} ms/step" if step_s else "no metrics"
            parts.append(
                f'<g class="rank" data-rank="{_e(row.get("rank"))}"><rect x="{cx}" y="{cy}" '
                f'width="{CELL_W}" height="{CELL_H}" rx="8" fill="{colour}"/>'
                f'<text x="{cx + 8}" y="{cy + 18}" font-size="13" font-weight="700" '
                f'fill="#fff">rank {_e(row.get("rank"))}</text><text x="{cx + CELL_W - 8}" '
                f'y="{cy + 18}" font-size="11" fill="#fff" text-anchor="end">'
                f'{_e(row.get("device", ""))}</text><text x="{cx + 8}" y="{cy + 35}" '
                f'font-size="12" fill="#fff">{_e(_coord(row, sizes))}</text>'
                f'<text x="{cx + 8}" y="{cy + 51}" font-size="11" fill="#fff">{_e(timing)}'
                f'</text><title>{_e(_rank_tooltip(row))}</title></g>')
        parts.append("</g>")
    parts += _links_svg(links or [], pos, box_w, box_h, status)
    return (f'<svg class="mesh" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}">{"".join(parts)}</svg>')


def _far(link: dict[str, Any], index: dict[str, int], ids: dict[str, str]) -> bool:
    """A link between nodes that are not side by side (drawn as an arc below the boxes);
    ``index``: node key -> box position, ``ids``: node id -> IP."""
    a, b = (ids.get(str(link.get(e)), str(link.get(e))) for e in ("a", "b"))
    return a in index and b in index and abs(index[a] - index[b]) > 1


def step_summary(run: dict[str, Any]) -> str:
    """'median 100 ms/step · slowest rank 3: 250 ms (2.5x)' from the ranks' latest step time."""
    times = {r.get("rank"): t for r in run.get("ranks", [])
             if (t := _num(r.get("step_s"))) is not None and t > 0}
    if not times:
        return "no step metrics yet"
    median = statistics.median(times.values())
    rank, slow = max(times.items(), key=lambda kv: kv[1])
    return (f"median {median * 1000:.0f} ms/step · slowest rank {rank}: {slow * 1000:.0f} ms "
            f"({slow / median:.2f}x)")


def _rank_tooltip(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in row.items() if v not in ("", None))


def _links_svg(links: list[dict[str, Any]], pos: dict[str, tuple[float, float]], box_w: float,
               box_h: list[int], status: ClusterStatus) -> list[str]:
    ids = {str(n.get("node_id")): str(n.get("ip")) for n in status.nodes}
    index = {key: i for i, key in enumerate(pos)}
    out = []
    arcs = 0
    for k, link in enumerate(links):
        a, b = (ids.get(str(link.get(e)), str(link.get(e))) for e in ("a", "b"))
        if a not in pos or b not in pos or a == b:
            continue
        ia, ib = index[a], index[b]
        if abs(ia - ib) > 1:  # an arc below the boxes: a few, or the page is only arcs
            arcs += 1
            if arcs > MAX_ARCS:
                continue
        (ax, ay), (bx, by) = sorted((pos[a], pos[b]))
        ha, hb = box_h[ia], box_h[ib]
        y1, y2 = ay + ha / 2, by + hb / 2
        x1, x2 = ax + box_w, bx
        lift = 0 if abs(ia - ib) == 1 else 30 + 14 * min(k, MAX_ARCS)
        mid_x, mid_y = (x1 + x2) / 2, max(y1, y2) + lift if lift else (y1 + y2) / 2
        path = (f"M{x1},{y1} L{x2},{y2}" if not lift else
                f"M{ax + box_w / 2},{ay + ha} Q{mid_x},{mid_y + 60} {bx + box_w / 2},{by + hb}")
        mbit = _num(link.get("mbit_s"))
        label = f"{_fmt(mbit)} Mbit/s" if mbit is not None else "link"
        ly = mid_y - 8 if not lift else mid_y + 26
        out.append(f'<g class="link"><path d="{path}" fill="none" stroke="#4a6fa5" '
                   f'stroke-width="3" stroke-dasharray="{"" if mbit else "6 4"}"/>'
                   f'<rect x="{mid_x - 52}" y="{ly - 14}" width="104" height="20" rx="10" '
                   f'fill="#fff" stroke="#4a6fa5"/><text class="link-label" x="{mid_x}" '
                   f'y="{ly}" font-size="12" text-anchor="middle" fill="#1d2733">'
                   f'{_e(label)}</text><title>{_e(a)} ↔ {_e(b)}</title></g>')
    return out


# ----------------------------------------------------------------------------- curves
def run_point(run: dict[str, Any], now: float | None = None) -> dict[str, float]:
    """The run's current point for the curves: step, mean loss, mean samples/s per rank."""
    point: dict[str, float] = {"t": now if now is not None else time.time()}
    for key, col in (("step", "step"), ("loss", "loss"), ("samples_per_s", "samples/s"),
                     ("tokens_per_s", "tokens/s")):
        vals = [v for v in (_num(r.get(col)) for r in run.get("ranks", [])) if v is not None]
        if vals:
            point[key] = max(vals) if key == "step" else statistics.fmean(vals)
    return point


def curve_svg(points: list[dict[str, float]], key: str, title: str, colour: str,
              width: int = 410, height: int = 210) -> str:
    """A line chart of ``key`` against step (or time when no step), with min/max ticks."""
    x_key = "step" if all("step" in p for p in points) else "t"
    xy = [(p[x_key], p[key]) for p in points if key in p and x_key in p]
    left, right, top, bottom = 58, 14, 30, 34
    parts = [f'<text x="{left}" y="18" font-size="13" font-weight="600" fill="#1d2733">'
             f'{_e(title)}</text>',
             f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" '
             f'y2="{height - bottom}" stroke="#9aa6b4"/><line x1="{left}" y1="{top}" '
             f'x2="{left}" y2="{height - bottom}" stroke="#9aa6b4"/>']
    if len(xy) < 2:
        parts.append(f'<text x="{width / 2}" y="{height / 2}" font-size="12" fill="#5b6878" '
                     f'text-anchor="middle">{len(xy)} point(s) so far: render again later '
                     f'to draw a curve</text>')
    else:
        xs, ys = [p[0] for p in xy], [p[1] for p in xy]
        x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
        if y0 == y1:  # a flat series: centre it
            y0, y1 = y0 - (abs(y0) * 0.1 or 1.0), y1 + (abs(y1) * 0.1 or 1.0)
        span_x, span_y = (x1 - x0) or 1.0, y1 - y0
        w, h = width - left - right, height - top - bottom

        def sx(v: float) -> float:
            return left + (v - x0) / span_x * w

        def sy(v: float) -> float:
            return top + h - (v - y0) / span_y * h

        d = " ".join(f"{'M' if i == 0 else 'L'}{sx(x):.1f},{sy(y):.1f}"
                     for i, (x, y) in enumerate(xy))
        parts.append(f'<path class="curve" data-key="{_e(key)}" d="{d}" fill="none" '
                     f'stroke="{colour}" stroke-width="2.2" stroke-linejoin="round"/>')
        for v in (y0, y1):
            parts.append(f'<text x="{left - 6}" y="{sy(v) + 4:.1f}" font-size="11" '
                         f'fill="#5b6878" text-anchor="end">{_fmt(v)}</text>')
        xlabel = "step" if x_key == "step" else "time (s)"
        for v, anchor in ((x0, "start"), (x1, "end")):
            shown = v if x_key == "step" else v - x0
            parts.append(f'<text x="{sx(v):.1f}" y="{height - bottom + 16}" font-size="11" '
                         f'fill="#5b6878" text-anchor="{anchor}">{_fmt(shown)}</text>')
        parts.append(f'<text x="{left + w / 2}" y="{height - 4}" font-size="11" '
                     f'fill="#5b6878" text-anchor="middle">{xlabel}</text>')
    return (f'<svg class="chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}">{"".join(parts)}</svg>')


# ----------------------------------------------------------------------------- page
def previous_data(path: str | Path) -> dict[str, Any]:
    """The data embedded in an earlier render of ``path`` ({} when none or unreadable)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return {}
    m = re.search(rf'<script type="application/json" id="{DATA_ID}">(.*?)</script>', text, re.S)
    try:
        return json.loads(html.unescape(m.group(1))) if m else {}
    except ValueError:
        return {}


def merge_history(history: dict[str, list[dict[str, float]]], status: ClusterStatus,
                  now: float | None = None) -> dict[str, list[dict[str, float]]]:
    """``history`` with every run's current point appended (a repeated step replaces)."""
    out = {k: list(v) for k, v in history.items()}
    for run in status.runs:
        point = run_point(run, now)
        if len(point) == 1:
            continue
        series = out.setdefault(run["name"], [])
        if series and "step" in point and series[-1].get("step") == point["step"]:
            series[-1] = point
        else:
            series.append(point)
        del series[:-HISTORY_MAX]
    return out


def _legend() -> str:
    items = (("ok", "step time within 10 % of the run's median"), ("slow", "10-50 % slower"),
             ("bad", "> 50 % slower"), ("none", "no metrics yet"))
    return '<div class="legend">' + "".join(
        f'<span><i style="background:{COLOURS[k]}"></i>{_e(t)}</span>' for k, t in items
    ) + "</div>"


def groups_html(groups: dict[str, Any]) -> str:
    """The run's replica groups: each one's layout, speed and share of the samples (a bar)."""
    shares = groups.get("shares", {})
    total = sum(s["samples"] for s in shares.values()) or 1
    live = set(groups.get("live", []))
    rows = []
    for gid, s in sorted(shares.items()):
        pct = 100 * s["samples"] / total
        speed = "-" if s["samples_per_s"] is None else f"{s['samples_per_s']:.1f}"
        rows.append(f"<tr><td>{gid}{'' if gid in live else ' (away)'}</td>"
                    f"<td>{_e(s.get('layout') or '-')}</td><td>{s['ranks']}</td>"
                    f"<td>{speed}</td><td>{s['samples']}</td><td><span class='bar' "
                    f"style='width:{pct:.0f}px'></span> {pct:.0f}%</td></tr>")
    return (f"<div class='groups'><h3>Replica groups: step {groups.get('step', 0)}</h3><table>"
            "<tr><th>group</th><th>layout</th><th>ranks</th><th>samples/s</th>"
            "<th>samples per segment</th><th>share</th></tr>" + "".join(rows)
            + "</table></div>")


def render(status: ClusterStatus, *, links: list[dict[str, Any]] | None = None,
           history: dict[str, list[dict[str, float]]] | None = None,
           title: str = "ray_mesh status") -> str:
    """The whole page. ``history``: run name -> points (see :func:`run_point`)."""
    history = history or {}
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    body = [f"<h1>{_e(title)}</h1><div class='meta'>{_e(status.dashboard)} · {len(status.nodes)}"
            f" node(s) · {len(status.runs)} run(s) · rendered {when}</div>"]
    runs = status.runs or [None]
    for run in runs:
        if run is not None and run.get("malformed"):  # a report ray_mesh did not write
            body.append(f"<div class='card malformed'><h2>Run {_e(run['name'])}</h2><div "
                        f"class='note'>malformed ({_e(run['malformed'])})</div></div>")
            continue
        if run is None:
            body.append("<div class='card'><h2>No running ray_mesh runs</h2>")
        else:
            body.append(f"<div class='card'><h2>Run {_e(run['name'])} "
                        f"<span class='meta'>[{_e(run.get('status', ''))}] layout "
                        f"{_e(run.get('layout') or run.get('mesh', ''))} · started "
                        f"{_e(run.get('started', ''))}"
                        f"</span></h2><div class='meta'>{_e(step_summary(run))}</div>")
            slow = run.get("slow") or {}
            body.append(f"<div class='meta verdict'>verdict: "
                        f"{_e(slow.get('verdict') or 'no slow rank or link')}</div>")
        body.append(mesh_svg(status, run, links or ((run or {}).get("slow") or {}).get("links")))
        body.append(_legend())
        if run is not None and run.get("replica_groups"):
            body.append(groups_html(run["replica_groups"]))
        if run is not None:
            points = history.get(run["name"], [])
            rate = "tokens_per_s" if any("tokens_per_s" in p for p in points) else \
                "samples_per_s"
            body.append("<div class='curves'>" + curve_svg(points, "loss", "loss", "#d64545")
                        + curve_svg(points, rate, rate.replace("_per_s", "/s per rank"),
                                    "#2f6fd0") + "</div>")
        body.append("</div>")
    body += [f"<p class='note'>note: {_e(n)}</p>" for n in status.notes]
    data = json.dumps({"history": history, "links": links or []})
    return ("<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>"
            + "".join(body)
            + f'<script type="application/json" id="{DATA_ID}">{html.escape(data, quote=False)}'
            "</script></body></html>")


def write_html(path: str | Path, status: ClusterStatus, *,
               links: list[dict[str, Any]] | None = None) -> Path:
    """Render ``status`` to ``path``, extending the curves of an earlier render there."""
    old = previous_data(path)
    history = merge_history(old.get("history", {}), status)
    links = links if links is not None else getattr(status, "links", None) or old.get("links")
    path = Path(path)
    path.write_text(render(status, links=links, history=history), encoding="utf-8")
    return path
