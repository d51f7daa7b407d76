"""``ray-mesh status``: the cluster's nodes and its ray_mesh runs, with layout and metrics.

Everything comes from what a running cluster already publishes, read over HTTP from the
head's dashboard, so the command needs no driver connection (and creates no Ray job):

* nodes: the dashboard's state API (``/api/v0/nodes``);
* runs: Ray Train V2's run state (``/api/train/v2/runs/v1``; the driver must run with
  ``RAY_TRAIN_ENABLE_STATE_TRACKING=1``); a run is a ray_mesh run when its backend config
  carries a ``mesh`` (``MeshConfig.to_dict``);
* layout: the ``ray_mesh_layout.json`` rank 0 saved in the run directory, when the viewer
  named that storage (``--storage``), else rebuilt from the Train state's workers and the
  mesh spec (interfaces are then unknown);
* latest step metrics: the ray_mesh series on every node's Prometheus endpoint (targets
  from ``/api/prometheus/sd``, on the cluster's own node IPs only), matched to ranks by the
  ``run`` and ``rank`` tags.

What the cluster says is not trusted (:mod:`ray_mesh.observability.status_input`): every
answer has a byte cap and must arrive whole within ``timeout_s``, the whole command within
``total_s`` (:mod:`ray_mesh.observability.fetch`); a storage path the cluster reports is
never opened unless the viewer named it, since opening it would use this machine's cloud
credentials on a place the cluster chose; a report that is not what ray_mesh writes is shown
as ``malformed (why)``; every string is printed escaped
(:func:`~ray_mesh.core.safe.safe_text`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import socket
import threading
import urllib.error
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray_mesh.private_apis as private_apis
from ray_mesh.core.safe import safe_text
from ray_mesh.core.spec import DIM_NAMES
from ray_mesh.core.table import text_table
from ray_mesh.errors import StatusError
from ray_mesh.network.interfaces import host_port, split_host_port
from ray_mesh.observability import replica_groups
from ray_mesh.observability import status_input as si
from ray_mesh.observability.fetch import (
    Deadline,
    SourceError,
    _origin,  # noqa: F401 - re-exported: tests/unit/test_status_redirect.py reads it here
    http_get,
    patiently,
)
from ray_mesh.observability.layout import layout_from_state, read_run_layout
from ray_mesh.observability.slow import analyze_run, format_analysis
from ray_mesh.status.metrics import (
    LATEST,
    METRICS_MAX_BYTES,
    RAW,
    latest_by_rank,
    scrape,
)
from ray_mesh.status.metrics import parse_series as parse_series

ACTIVE = ("INITIALIZING", "SCHEDULING", "RUNNING", "RESTARTING", "RESIZING")
DEFAULT_DASHBOARD_PORT = 8265
DEFAULT_TOTAL_S = 30.0
MAX_BYTES = 32 * 2**20  # one dashboard answer or layout file
NODE_LIMIT = 10_000


@dataclass
class ClusterStatus:
    dashboard: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- transport
def _enable_token_auth() -> None:
    """Send the cluster token when one exists (a cluster with token authentication, Ray's
    default, refuses calls without it)."""
    # Quietly (the wrapper silences Ray's note on the auth default); never fatal here.
    with contextlib.suppress(Exception):
        private_apis.enable_token_auth()


def _auth_headers() -> dict[str, str]:
    try:
        return private_apis.auth_headers()
    except Exception:  # noqa: BLE001
        return {}


def _get(url: str, timeout_s: float, headers: dict[str, str] | None = None, *,
         max_bytes: int = MAX_BYTES, what: str | None = None,
         deadline: Deadline | None = None) -> bytes:
    """``url``'s body, bounded (:func:`ray_mesh.observability.fetch.http_get`)."""
    return http_get(url, timeout_s=timeout_s, max_bytes=max_bytes, headers=headers, what=what,
                    deadline=deadline)


def _tcp_check(host: str, port: int, timeout_s: float, what: str) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return
    except OSError as exc:
        raise StatusError(
            f"The {what} at {host_port(host, port)} does not answer ({exc}). Check the address and "
            f"port, that Ray runs there (`ray status` on the head node), and that this "
            f"machine can reach it (firewall, Tailscale up?)."
        ) from exc


def _split(address: str, default_port: int) -> tuple[str, int]:
    try:
        return split_host_port(address, default_port)
    except ValueError as exc:
        raise StatusError(f"Address {safe_text(address, 200)}: {exc}") from exc


def _advertised(url: str, address: str) -> str:
    """The dashboard URL a GCS advertised, if it is a plain http(s)://host:port."""
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    try:
        ok = (parts.scheme in ("http", "https") and parts.hostname and not parts.username
              and parts.path in ("", "/") and not parts.query and not parts.fragment
              and parts.port is not None)
    except ValueError:
        ok = False
    if not ok:
        raise StatusError(f"The Ray cluster at {safe_text(address, 200)} advertises its "
                          f"dashboard as {safe_text(url, 200)!r}, which is not "
                          f"http(s)://host:port; pass the dashboard directly: --address "
                          f"http://<head>:8265.")
    return f"{parts.scheme}://{parts.netloc}"


def _dashboard_from_gcs(address: str, timeout_s: float) -> str:
    """Ask the GCS at ``address`` for the dashboard's URL, in a bounded thread."""
    out: dict[str, Any] = {}

    def ask() -> None:
        try:
            out["url"] = private_apis.dashboard_url_from_gcs(address)
        except Exception as exc:  # noqa: BLE001
            out["error"] = exc

    worker = threading.Thread(target=ask, daemon=True)
    worker.start()
    worker.join(timeout_s)
    if "url" in out:
        return _advertised(str(out["url"]), address)
    why = safe_text(out.get("error") or f"no answer within {timeout_s:.0f} s", 300)
    raise StatusError(
        f"The Ray cluster at {address} did not tell its dashboard address ({why}). If the "
        f"cluster uses token authentication, make its token available here (~/.ray/auth_token "
        f"or RAY_AUTH_TOKEN); or pass the dashboard directly: --address http://<head>:8265."
    )


def dashboard_url(address: str | None, timeout_s: float = 5.0) -> str:
    """The dashboard URL for ``address``: a URL as given, a GCS ``host:port``, or local."""
    address = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get(
        "RAY_ADDRESS")
    if not address or address == "auto":
        address = f"http://127.0.0.1:{DEFAULT_DASHBOARD_PORT}"
    if address.startswith("ray://"):
        raise StatusError(f"{address!r} is a Ray Client address: pass the GCS address "
                          f"(<head>:6379) or the dashboard (http://<head>:8265).")
    if "://" in address:
        if not address.lower().startswith(("http://", "https://")):
            raise StatusError(f"{safe_text(address, 200)!r}: the dashboard is read over "
                              f"http(s) only: give http://<head>:8265 or <head>:6379.")
        url = address.rstrip("/")
        host, port = _split(url.split("://", 1)[1].split("/", 1)[0], DEFAULT_DASHBOARD_PORT)
        _tcp_check(host, port, timeout_s, "Ray dashboard")
        return url
    host, port = _split(address, 6379)
    _tcp_check(host, port, timeout_s, "Ray cluster (GCS)")
    return _dashboard_from_gcs(address, max(timeout_s, 10.0))


def _dashboard_json(base: str, path: str, timeout_s: float, *,
                    deadline: Deadline | None = None, max_bytes: int = MAX_BYTES) -> Any:
    what = f"the dashboard's answer to {path.split('?')[0]}"
    headers = _auth_headers()

    def ask(bound_s: float) -> bytes:
        return _get(base + path, bound_s, headers, max_bytes=max_bytes, what=what,
                    deadline=deadline)

    try:
        data = patiently(ask, timeout_s, deadline, what)
    except urllib.error.HTTPError as exc:
        body = getattr(exc, "body_text", "")
        if exc.code in (401, 403):
            raise StatusError(
                f"The dashboard at {base} refused the request ({exc.code}: {body}). Make the "
                f"cluster's token available here: ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
                f"RAY_AUTH_TOKEN (`ray get-auth-token` on the head prints it)."
            ) from exc
        raise StatusError(f"{base}{path} answered {exc.code}: {body}") from exc
    except SourceError as exc:
        raise StatusError(f"{exc}. Raise --timeout/--deadline or --max-mb if the cluster is "
                          f"just large or slow; else check what answers at {base}.") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise StatusError(
            f"The dashboard at {base} does not answer {path} ({safe_text(exc, 300)}). Is the "
            f"head started with the dashboard (ray[default] installed, "
            f"--include-dashboard=true)?"
        ) from exc
    try:
        return si.load_json(data, what)
    except si.Malformed as exc:
        raise StatusError(str(exc)) from exc


# ----------------------------------------------------------------------------- sources
def _nodes(base: str, timeout_s: float, deadline: Deadline | None = None,
           max_bytes: int = MAX_BYTES) -> tuple[list[dict[str, Any]], list[str]]:
    """The cluster's nodes (the state API ``ray list nodes`` reads), and malformed ones."""
    path = f"/api/v0/nodes?limit={NODE_LIMIT}&timeout={int(max(timeout_s, 1))}&detail=true"
    doc = _dashboard_json(base, path, timeout_s, deadline=deadline, max_bytes=max_bytes)
    try:
        return si.parse_nodes(doc)
    except si.Malformed as exc:
        raise StatusError(f"The dashboard at {base}: {exc}") from exc


def scrape_targets(base: str, timeout_s: float, node_ips: Sequence[str] = (), *,
                   deadline: Deadline | None = None) -> tuple[list[str], list[str]]:
    """Every node's ``ip:port`` Prometheus target (Ray's own service discovery), kept only
    on the cluster's node IPs; and the targets left out."""
    content = _dashboard_json(base, "/api/prometheus/sd", timeout_s, deadline=deadline,
                              max_bytes=METRICS_MAX_BYTES)
    return si.targets_of(content, node_ips)


def _malformed_run(r: Any, why: str) -> dict[str, Any]:
    return {"name": si.run_label(r), "id": "?", "status": "?", "started": "?", "mesh": "?",
            "layout": "?", "layout_source": "none", "ranks": [], "slow": None, "malformed": why}


def _run_entry(run: dict[str, Any], samples: list[tuple[str, dict, float]],
               storage: Sequence[str], timeout_s: float, deadline: Deadline,
               max_bytes: int, notes: list[str], endpoint: str | None = None
               ) -> dict[str, Any]:
    doc, why = read_run_layout(run, storage, timeout_s, max_bytes, endpoint, deadline)
    if why and why not in notes:
        notes.append(why)
    groups, why = replica_groups.read(run, storage, timeout_s, max_bytes, endpoint, deadline)
    if why:
        notes.append(why)
    rows = doc["ranks"] if doc else layout_from_state(run)
    metrics = latest_by_rank(samples, run["name"])
    ranks = [{**row, **metrics.get(row["rank"], {})} for row in rows]
    try:
        slow = analyze_run(ranks, samples, run["name"]).to_json()
    except Exception as exc:  # noqa: BLE001 - odd numbers must not hide the table
        slow = None
        notes.append(f"run {run['name']}: no slow-rank analysis ({type(exc).__name__}: "
                     f"{safe_text(exc, 200)})")
    started = _dt.datetime.fromtimestamp(run["start_time_ns"] / 1e9, _dt.timezone.utc)
    return {"name": run["name"], "id": run["id"], "status": run["status"],
            "started": started.strftime("%H:%M:%S UTC"),
            "mesh": doc["mesh"] if doc else safe_text(run["mesh"], 300),
            "layout": doc["layout"] if doc else run.get("layout", "?"),
            "layout_source": "run dir" if doc else "train state",
            "ranks": ranks, "slow": slow, "replica_groups": groups}


def _train_runs(base: str, timeout_s: float, all_runs: bool, deadline: Deadline,
                max_bytes: int, notes: list[str]) -> list[Any]:
    """The ray_mesh runs of the Train state (unchecked records), newest first."""
    try:
        data = _dashboard_json(base, "/api/train/v2/runs/v1", timeout_s, deadline=deadline,
                               max_bytes=max_bytes)
    except StatusError as exc:
        notes.append("Ray Train run state is off: start drivers with "
                     "RAY_TRAIN_ENABLE_STATE_TRACKING=1 to list runs here."
                     if "STATE_TRACKING" in str(exc) else f"runs not read: {exc}")
        return []
    runs = si.dig(data, "train_runs")
    if not isinstance(runs, list):
        notes.append(f"runs not read: the dashboard's answer to /api/train/v2/runs/v1 is "
                     f"malformed (train_runs is {type(runs).__name__}, not a list)")
        return []
    out = [r for r in runs if not isinstance(r, dict) or (
        si.mesh_of(r) is not None and (all_runs or r.get("status") in ACTIVE))]

    def start(r: Any) -> int:
        t = si.dig(r, "start_time_ns")
        return t if isinstance(t, int) and not isinstance(t, bool) else 0

    out.sort(key=start, reverse=True)
    if len(out) > si.MAX_RUNS:
        notes.append(f"{len(out) - si.MAX_RUNS} older run(s) not shown")
    return out[:si.MAX_RUNS]


def collect(address: str | None = None, *, timeout_s: float = 5.0, all_runs: bool = False,
            storage: Sequence[str] = (), total_s: float = DEFAULT_TOTAL_S,
            max_bytes: int = MAX_BYTES, storage_endpoint: str | None = None) -> ClusterStatus:
    """Ask the cluster at ``address`` for its nodes and ray_mesh runs (bounded).

    ``timeout_s`` bounds each answer, ``total_s`` the whole call, ``max_bytes`` each
    dashboard answer and layout file. Layout files are read only from ``storage``, the
    storage paths or URIs the viewer names (``storage_endpoint``: the S3 server of the
    ``s3://`` ones); a run whose storage is not among them gets its layout from the Train
    state.
    """
    deadline = Deadline(total_s)
    _enable_token_auth()
    base = dashboard_url(address, deadline.bound(timeout_s))
    nodes, notes = _nodes(base, timeout_s, deadline, max_bytes)
    status = ClusterStatus(dashboard=safe_text(base, 300), nodes=nodes)
    runs = _train_runs(base, timeout_s, all_runs, deadline, max_bytes, notes)
    samples: list[tuple[str, dict, float]] = []
    if any(isinstance(r, dict) for r in runs):
        try:
            targets, off = scrape_targets(base, timeout_s, [n["ip"] for n in nodes],
                                          deadline=deadline)
            if off:
                notes.append(f"metrics targets not one of the cluster's nodes, not scraped: "
                             f"{', '.join(off[:10])}")
            samples, problems = scrape(targets, timeout_s, deadline)
            notes += problems
        except StatusError as exc:
            notes.append(f"no metrics: {exc}")
    for r in runs:
        if not isinstance(r, dict):
            status.runs.append(_malformed_run(r, f"a run entry is {type(r).__name__}, not an "
                                                 f"object"))
            continue
        try:
            run = si.parse_run(r)
        except si.Malformed as exc:
            status.runs.append(_malformed_run(r, str(exc)))
            continue
        status.runs.append(_run_entry(run, samples, storage, timeout_s, deadline, max_bytes,
                                      notes, storage_endpoint))
    if deadline.slow:
        notes.append(f"a busy cluster: answered only when asked a second time (over --timeout "
                     f"{timeout_s:g} s): " + "; ".join(f"{what} after {t:.0f} s"
                                                       for what, t in deadline.slow))
    status.notes = notes
    return status


# ----------------------------------------------------------------------------- output
LAYOUT_COLUMNS = ["rank", "node", "node_ip", "interface", "device", *DIM_NAMES]


def _run_lines(run: dict[str, Any]) -> list[str]:
    if run.get("malformed"):
        return ["", f"Run {run['name']}: malformed ({run['malformed']})"]
    out = ["", f"Run {run['name']}  [{run['status']}]  started {run['started']}  "
               f"id {str(run['id'])[:12]}  layout {run.get('layout', '?')}  (layout from "
               f"{run['layout_source']})"]
    metric_cols = sorted({k for r in run["ranks"] for k in r if not k.startswith(RAW)}
                         - set(LAYOUT_COLUMNS) - {"hostname", "node_id", "local_rank"},
                         key=lambda c: (list(LATEST.values()) + [c]).index(c))
    if run["ranks"]:
        out.append(text_table(run["ranks"], LAYOUT_COLUMNS + metric_cols))
    if not metric_cols:
        out.append("(no step metrics yet: they appear ~10-20 s after the train function's "
                   "first ray_mesh.report)")
    if run.get("slow"):
        out += ["Slowest rank per dim, links, verdict:", *format_analysis(run["slow"])]
    if run.get("replica_groups"):
        out += replica_groups.lines(run["replica_groups"])
    return out


def format_status(status: ClusterStatus) -> str:
    """The console text; every value from the cluster is escaped (:func:`safe_text`)."""
    out = [f"Ray dashboard: {status.dashboard}", "", f"Nodes ({len(status.nodes)}):",
           text_table([{**n, "node_id": str(n["node_id"])[:12]} for n in status.nodes],
                      ["node_id", "ip", "state", "head", "CPU", "GPU"])]
    if not status.runs:
        out += ["", "No running ray_mesh runs."]
    for run in status.runs:
        out += _run_lines(run)
    out += [f"note: {safe_text(n)}" for n in status.notes]
    return safe_text("\n".join(out), multiline=True)
