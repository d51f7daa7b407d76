"""``ray-mesh status`` past one machine (issue 45): ``results.json["scale"]["status"]``.

``ray-mesh status`` reads everything over HTTP: the dashboard's node list
(``/api/v0/nodes``), Ray Train's run state (``/api/train/v2/runs/v1``), Ray's Prometheus
service discovery (``/api/prometheus/sd``) and then every node's Prometheus page
(``http://<node>:<port>/metrics``), whose ``ray_mesh_*`` series it parses, checks, matches to
ranks and analyses (slow rank, slow link) before it prints the table or renders the HTML
page. This benchmark serves what an N-node run would serve, from a child process on this
machine (one loopback address per node, ``127.1.x.y``, all on one port), and runs the real
command's path against it (:func:`ray_mesh.status.cluster.collect`,
:func:`~ray_mesh.status.cluster.format_status`,
:func:`~ray_mesh.status.html.write_html`), at 8, 32, 128 and 512 nodes of 8 ranks:

* the run: HSDP (``dp_replicate`` = nodes across nodes, ``dp_shard`` = 8 within a node), on
  GPUs; every rank exports the series of :data:`ray_mesh.observability.export.METRICS` a
  training rank writes (the per-dim waits for ``dp_replicate``, ``dp_shard`` and ``world``;
  the device memory; two ``mesh_report_<key>`` gauges), with the tags Ray adds; rank 0 also
  exports the node links (``ray_mesh_link_mbit``): those of the bring-up measurement
  (every pair) that :meth:`ray_mesh.network.links.LinkMatrix.exported` keeps, which is what
  the backend hands rank 0 (every pair up to 16 nodes, at most 3 per node past that);
* each node's page also holds :data:`RAY_SERIES` series of Ray's own (an assumption: a
  Ray node's page holds a few hundred);
* every rank waits 30 % of its window in ``dp_replicate`` (:data:`WAITS_S`), so the analysis
  goes the whole way a slow link takes it (the link matrix's slow-node test, the verdict);

Figures per size:

* ``series``: the ``ray_mesh_*`` samples on all pages (``rank_series``: of the ranks;
  ``link_series``: rank 0's link matrix), and ``page_mb``: the bytes of all pages, MiB;
* ``collect_s``, ``text_s``, ``html_s``: the three parts of ``ray-mesh status --html FILE``
  (reads, parse and analysis; the console text; the page), the median of ``repeats``
  after a first one; ``total_s`` their sum. Target: within 5 s at 128 nodes.
* ``ranks_with_metrics``: ranks whose row got their step time (every rank, or a page was
  lost: the byte cap, a timeout); ``notes``: the notes status printed.

Each figure comes with the fitted growth exponent ``k`` of ``figure ~ nodes**k`` (least
squares on the logs; 1 is linear). The machine's 1-minute load is recorded beside each size;
a size measured at a load above 2 is published as None.

    python -m benchmarks.scale_status [--out FILE] [--sizes 8 32 128 512]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.scale_quorum import MAX_LOAD, exponent, scale_main  # noqa: E402
from ray_mesh.core.layout import Layout  # noqa: E402
from ray_mesh.core.spec import DIM_NAMES, MeshSpec  # noqa: E402
from ray_mesh.network.links import Link, LinkMatrix, pair_rounds  # noqa: E402
from ray_mesh.observability.export import METRICS  # noqa: E402

SIZES = (8, 32, 128, 512)
PER_NODE = 8
REPEATS = 3
RAY_SERIES = 400  # Ray's own series on each node's page (an assumption)
RUN = "scale-bench"
WAIT_DIMS = ("dp_replicate", "dp_shard", "world")
REPORT_KEYS = ("loss", "lr")
RAY_TAGS = ('Component="core_worker",SessionName="session_2026_11_27_12_00_00_000000_1",'
            'Version="2.60.0"')
FIGURES = ("collect_s", "text_s", "html_s", "total_s", "series", "page_mb")


def node_ip(i: int) -> str:
    return f"127.1.{i // 200}.{i % 200 + 1}"


def measured_links(nodes: int) -> LinkMatrix:
    """What bring-up's measurement gives (``measure_links``: every pair once, each node to
    itself), 800-1000 Mbit/s between nodes."""
    pairs = [p for r in (pair_rounds(nodes) if nodes > 1 else []) for p in r]
    return LinkMatrix([Link(node_ip(a), node_ip(b), 800.0 + (a * 7919 + b * 104729) % 200)
                       for a, b in pairs] + [Link(node_ip(i), node_ip(i), 20000.0)
                                             for i in range(nodes)])


def exported_links(nodes: int) -> list[Link]:
    """The links rank 0 exports (``LinkMatrix.exported``, what the backend hands rank 0)."""
    matrix = measured_links(nodes)
    # A checkout before LinkMatrix.exported (the "before" figures) exported every link.
    return matrix.exported().links if hasattr(matrix, "exported") else matrix.links


def _labels(**tags: str) -> str:
    return ",".join(f'{k}="{v}"' for k, v in tags.items())


def _rank_tags(rank: int, node: int) -> dict[str, str]:
    coord = {"pp": 0, "dp_replicate": node, "dp_shard": rank % PER_NODE, "cp": 0, "tp": 0}
    return {"run": RUN, "rank": str(rank), "node_rank": str(node), "node_ip": node_ip(node),
            **{d: str(coord[d]) for d in DIM_NAMES}}


WAITS_S = {"dp_replicate": 3.0, "dp_shard": 0.4, "world": 0.1}  # of a 10 s window


def _value(name: str, rank: int, dim: str | None = None) -> float:
    if name == "mesh_dim_wait_seconds":  # dp_replicate above LINK_WAIT: the slow-link path
        return WAITS_S[dim or "world"]
    return {"mesh_step": 1000.0, "mesh_steps": 1000.0, "mesh_step_time_seconds": 520.0,
            "mesh_step_seconds": 0.5 + 0.001 * (rank % 7), "mesh_loss": 2.5,
            "mesh_compute_seconds": 6.5, "mesh_wait_window_seconds": 10.0,
            "mesh_process_rss_bytes": 6e9}.get(name, 1e6 + rank)


def node_page(i: int, nodes: int) -> tuple[bytes, int, int]:
    """Node ``i``'s Prometheus text; and its ray_mesh samples: of the ranks, of the links."""
    ray = _labels(NodeAddress=node_ip(i))
    out, rank_n, link_n = [], 0, 0
    for k in range(RAY_SERIES // 10):
        out += [f"# HELP ray_node_stat_{k} A Ray node statistic.",
                f"# TYPE ray_node_stat_{k} gauge"]
        out += [f'ray_node_stat_{k}{{{RAY_TAGS},{ray},slot="{j}"}} {k * j}.0' for j in range(10)]
    ranks = range(i * PER_NODE, (i + 1) * PER_NODE)
    for m in METRICS:
        if m.name in ("mesh_dim_allreduce_seconds", "mesh_dim_busbw_bytes_per_second"):
            continue  # probe_dims(): only when the train function calls it
        name = m.prometheus_name
        rows = []
        if m.name == "mesh_link_mbit":
            if i == 0:
                for link in exported_links(nodes):
                    rows.append(f'{name}{{{RAY_TAGS},{ray},WorkerId="w0",'
                                f'{_labels(**_rank_tags(0, 0))},a="{link.a}",'
                                f'b="{link.b}"}} {link.mbit_s}')
                link_n = len(rows)
        else:
            for r in ranks:
                tags = _labels(**_rank_tags(r, i))
                worker = f'WorkerId="{r:056x}"'
                dims = WAIT_DIMS if m.per_dim else (None,)
                for d in dims:
                    extra = f',dim="{d}"' if d else ""
                    rows.append(f"{name}{{{RAY_TAGS},{ray},{worker},{tags}{extra}}} "
                                f"{_value(m.name, r, d)}")
            rank_n += len(rows)
        if rows:
            out += [f"# HELP {name} {m.help}", f"# TYPE {name} {m.kind}", *rows]
    for key in REPORT_KEYS:
        name = f"ray_mesh_report_{key}"
        out += [f"# HELP {name} reported {key}", f"# TYPE {name} gauge"]
        out += [f"{name}{{{RAY_TAGS},{ray},{_labels(**_rank_tags(r, i))}}} 0.1" for r in ranks]
        rank_n += PER_NODE
    return ("\n".join(out) + "\n").encode(), rank_n, link_n


def dashboard_docs(nodes: int, port: int) -> dict[str, bytes]:
    """The dashboard's three answers for an N-node run, by path (without the query)."""
    node_list = [{"node_id": f"{i:056x}", "node_ip": node_ip(i), "state": "ALIVE",
                  "is_head_node": i == 0, "node_name": node_ip(i),
                  "resources_total": {"CPU": 64.0, "GPU": float(PER_NODE), "memory": 5e11},
                  "labels": {"ray.io/node_id": f"{i:056x}"}} for i in range(nodes)]
    workers = [{"world_rank": r, "local_rank": r % PER_NODE, "node_rank": r // PER_NODE,
                "node_ip": node_ip(r // PER_NODE), "gpu_ids": [r % PER_NODE],
                "actor_id": f"{r:032x}", "node_id": f"{r // PER_NODE:056x}", "pid": 1000 + r,
                "status": "ALIVE"} for r in range(nodes * PER_NODE)]
    mesh = MeshSpec.from_dict({"dp_replicate": "nodes", "dp_shard": -1})
    layout = str(Layout(mesh.resolve(nodes * PER_NODE, num_nodes=nodes)))
    run = {"id": "0123456789abcdef", "name": RUN, "status": "RUNNING",
           "start_time_ns": 1_790_000_000_000_000_000,
           "run_settings": {"backend_config": {"config": {"mesh": mesh.to_dict(),
                                                          "layout": layout}},
                            "run_config": {"storage_path": "/nonexistent/ray_results"}},
           "attempts": [{"workers": workers}]}
    sd = [{"labels": {"job": "ray"}, "targets": [f"{node_ip(i)}:{port}" for i in range(nodes)]}]
    return {"/api/v0/nodes": json.dumps({"result": True, "msg": "", "data": {"result": {
                "total": nodes, "result": node_list}}}).encode(),
            "/api/train/v2/runs/v1": json.dumps({"train_runs": [run]}).encode(),
            "/api/prometheus/sd": json.dumps(sd).encode()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(nodes: int, port: int, conn) -> None:  # noqa: ANN001 - a multiprocessing pipe
    """The child process: the dashboard on 127.0.0.1 and every node's page on its address."""
    pages, sizes = {}, {"rank_series": 0, "link_series": 0, "bytes": 0}
    for i in range(nodes):
        page, rank_n, link_n = node_page(i, nodes)
        pages[node_ip(i)] = page
        sizes["rank_series"] += rank_n
        sizes["link_series"] += link_n
        sizes["bytes"] += len(page)
    docs = dashboard_docs(nodes, port)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            path = head.split(b" ", 2)[1].decode().split("?")[0]
            host = writer.get_extra_info("sockname")[0]
            body = docs.get(path) if host == "127.0.0.1" else pages.get(host) \
                if path == "/metrics" else None
            status = b"200 OK" if body is not None else b"404 Not Found"
            body = body if body is not None else b"not here"
            writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: text/plain\r\n"
                         b"Content-Length: " + str(len(body)).encode()
                         + b"\r\nConnection: close\r\n\r\n" + body)
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError, IndexError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        hosts = ["127.0.0.1", *(node_ip(i) for i in range(nodes))]
        server = await asyncio.start_server(answer, host=hosts, port=port, backlog=256)
        conn.send(sizes)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)  # until the parent says stop
        server.close()

    asyncio.run(main())


def status_once(address: str, html_path: str) -> dict:
    """One ``ray-mesh status --html FILE``, timed in its three parts."""
    from ray_mesh.status.cluster import collect, format_status
    from ray_mesh.status.html import write_html

    t0 = time.perf_counter()
    status = collect(address, timeout_s=5.0, total_s=60.0)
    t1 = time.perf_counter()
    text = format_status(status)
    t2 = time.perf_counter()
    Path(html_path).unlink(missing_ok=True)  # no history from the previous repeat
    write_html(html_path, status)
    t3 = time.perf_counter()
    run = status.runs[0] if status.runs else {"ranks": []}
    return {"collect_s": t1 - t0, "text_s": t2 - t1, "html_s": t3 - t2, "total_s": t3 - t0,
            "ranks": len(run["ranks"]),
            "ranks_with_metrics": sum(1 for r in run["ranks"] if "step_s" in r),
            "links_read": len((run.get("slow") or {}).get("links", [])),
            "notes": [n[:200] for n in status.notes], "text_kb": len(text) / 1024,
            "html_kb": Path(html_path).stat().st_size / 1024}


def measure_size(nodes: int, repeats: int = REPEATS) -> dict:
    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(nodes, port, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(300):
            raise RuntimeError("the fake cluster did not start within 300 s")
        sizes = parent.recv()
        with tempfile.TemporaryDirectory() as tmp:
            html_path = str(Path(tmp) / "mesh.html")
            address = f"http://127.0.0.1:{port}"
            status_once(address, html_path)  # imports, first connections
            runs = [status_once(address, html_path) for _ in range(repeats)]
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    out = {k: statistics.median(r[k] for r in runs)
           for k in ("collect_s", "text_s", "html_s", "total_s")}
    last = runs[-1]
    out.update({k: last[k] for k in ("ranks", "ranks_with_metrics", "links_read", "notes",
                                     "text_kb", "html_kb")})
    out.update({"series": sizes["rank_series"] + sizes["link_series"],
                "rank_series": sizes["rank_series"], "link_series": sizes["link_series"],
                "page_mb": sizes["bytes"] / 2**20})
    return out


def measure(sizes: tuple[int, ...] = SIZES) -> dict:
    rows = []
    for n in sizes:
        load = os.getloadavg()[0]
        got = measure_size(n)
        after = os.getloadavg()[0]
        ok = max(load, after) <= MAX_LOAD
        timed = ("collect_s", "text_s", "html_s", "total_s")
        rows.append({"nodes": n, "ranks_per_node": PER_NODE,
                     **{k: (round(got[k], 4) if ok else None) for k in timed},
                     **{k: got[k] for k in ("series", "rank_series", "link_series",
                                            "ranks", "ranks_with_metrics", "links_read",
                                            "notes")},
                     "page_mb": round(got["page_mb"], 3), "text_kb": round(got["text_kb"], 1),
                     "html_kb": round(got["html_kb"], 1),
                     "recorded_s": {k: round(got[k], 4) for k in timed},
                     "load_1min": [round(load, 2), round(after, 2)]})
        print(f"{n:4d} nodes: status {got['total_s']:.2f} s (collect {got['collect_s']:.2f}, "
              f"text {got['text_s']:.2f}, html {got['html_s']:.2f}); {got['series']} series "
              f"({got['link_series']} links), {got['page_mb']:.1f} MiB; metrics on "
              f"{got['ranks_with_metrics']}/{got['ranks']} ranks; {len(got['notes'])} note(s) "
              f"(load {load:.2f} -> {after:.2f})", flush=True)
    ns = [r["nodes"] for r in rows]
    return {"sizes": rows,
            "growth_exponent": {
                **{k: exponent(ns, [r[k] for r in rows])
                   for k in ("collect_s", "text_s", "html_s", "total_s")},
                **{k: exponent(ns, [r[k] for r in rows])
                   for k in ("series", "rank_series", "link_series", "page_mb")}},
            "targets": {"total_s": "<= 5 at 128 nodes",
                        "growth_exponent": "no figure faster than n log n"},
            "statistic": {"collect_s": f"median of {REPEATS} after a first one",
                          "series": "counted on the pages served"},
            "assumptions": {"ranks_per_node": PER_NODE, "ray_series_per_node": RAY_SERIES,
                            "layout": "HSDP, dp_replicate = nodes, dp_shard = 8",
                            "transport": "loopback HTTP from a child process"},
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def main(argv: list[str] | None = None) -> int:
    return scale_main(argv, __doc__, "status", measure, SIZES)


if __name__ == "__main__":
    raise SystemExit(main())
