"""``ray-mesh status``: the cluster's nodes and its ray_mesh runs, with layout and metrics.

Everything comes from what a running cluster already publishes, read over HTTP from the
head's dashboard, so the command needs no driver connection (and creates no Ray job):

* nodes: Ray's state API (``ray.util.state.list_nodes``);
* runs: Ray Train V2's run state (``/api/train/v2/runs/v1``; the driver must run with
  ``RAY_TRAIN_ENABLE_STATE_TRACKING=1``); a run is a ray_mesh run when its backend config
  carries a ``mesh`` (``MeshConfig.to_dict``);
* layout: the ``ray_mesh_layout.json`` rank 0 saved in the run directory when that storage
  is readable from here, else rebuilt from the Train state's workers and the mesh spec
  (interfaces are then unknown);
* latest step metrics: the ray_mesh series on every node's Prometheus endpoint (targets
  from ``/api/prometheus/sd``), matched to ranks by the ``run`` and ``rank`` tags.

Every request is bounded; an address that does not answer fails within seconds with what
to check.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import ray_mesh.private_apis as private_apis
from ray_mesh.core.spec import DIM_NAMES, MeshSpec
from ray_mesh.core.table import text_table
from ray_mesh.errors import StatusError
from ray_mesh.network.interfaces import host_port, split_host_port
from ray_mesh.observability.layout import read_layout
from ray_mesh.observability.slow import analyze_run, format_analysis

ACTIVE = ("INITIALIZING", "SCHEDULING", "RUNNING", "RESTARTING", "RESIZING")
DEFAULT_DASHBOARD_PORT = 8265


@dataclass
class ClusterStatus:
    dashboard: str
    nodes: list[dict[str, Any]] = field(default_factory=list)
    runs: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- transport
def _enable_token_auth() -> None:
    """Send the cluster token when one exists (Ray 2.60 clusters require it by default)."""
    # Quietly (the wrapper silences Ray's note on the auth default); never fatal here.
    with contextlib.suppress(Exception):
        private_apis.enable_token_auth()


def _auth_headers() -> dict[str, str]:
    try:
        return private_apis.auth_headers()
    except Exception:  # noqa: BLE001
        return {}


SECRET_HEADERS = ("authorization", "x-ray-authorization", "cookie", "proxy-authorization")


def _origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) with the scheme's default port filled in."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(
        scheme)


class _SameOriginCredentials(urllib.request.HTTPRedirectHandler):
    """Follow redirects, but send the cluster token only to the origin it was meant for.

    urllib copies every header to the redirect target, so a dashboard (or anything in
    between) answering 302 to another host would receive the bearer token. A redirect to
    another scheme, host or port drops the credential headers; the request then fails there
    with 401/403 unless that origin needs no token.
    """

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: ANN001, D102
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and _origin(newurl) != _origin(req.full_url):
            for name in list(new.headers):
                if name.lower() in SECRET_HEADERS:
                    del new.headers[name]
        return new


_OPENER = urllib.request.build_opener(_SameOriginCredentials)


def _get(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with _OPENER.open(req, timeout=timeout_s) as resp:  # noqa: S310 - user's cluster
        return resp.read()


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
        raise StatusError(f"Address {address!r}: {exc}") from exc


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
        return str(out["url"])
    why = out.get("error") or f"no answer within {timeout_s:.0f} s"
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
        url = address.rstrip("/")
        host, port = _split(url.split("://", 1)[1].split("/", 1)[0], DEFAULT_DASHBOARD_PORT)
        _tcp_check(host, port, timeout_s, "Ray dashboard")
        return url
    host, port = _split(address, 6379)
    _tcp_check(host, port, timeout_s, "Ray cluster (GCS)")
    return _dashboard_from_gcs(address, max(timeout_s, 10.0))


def _dashboard_json(base: str, path: str, timeout_s: float) -> Any:
    try:
        return json.loads(_get(base + path, timeout_s, _auth_headers()))
    except urllib.error.HTTPError as exc:
        body = exc.read().decode("utf-8", "replace")[:300]
        if exc.code in (401, 403):
            raise StatusError(
                f"The dashboard at {base} refused the request ({exc.code}: {body}). Make the "
                f"cluster's token available here: ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or "
                f"RAY_AUTH_TOKEN (`ray get-auth-token` on the head prints it)."
            ) from exc
        raise StatusError(f"{base}{path} answered {exc.code}: {body}") from exc
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        raise StatusError(
            f"The dashboard at {base} does not answer {path} ({exc}). Is the head started "
            f"with the dashboard (ray[default] installed, --include-dashboard=true)?"
        ) from exc


# ----------------------------------------------------------------------------- sources
def _nodes(base: str, timeout_s: float) -> list[dict[str, Any]]:
    from ray.util.state import list_nodes

    try:
        nodes = list_nodes(address=base, detail=True, timeout=int(max(timeout_s, 1)),
                           raise_on_missing_output=False)
    except Exception as exc:  # noqa: BLE001
        raise StatusError(f"Listing nodes through {base} failed: {type(exc).__name__}: "
                          f"{exc}") from exc
    out = []
    for n in nodes:
        res = n.resources_total or {}
        out.append({"node_id": n.node_id, "ip": n.node_ip, "state": n.state,
                    "head": bool(n.is_head_node), "CPU": res.get("CPU", 0),
                    "GPU": res.get("GPU", 0)})
    return sorted(out, key=lambda n: (not n["head"], n["ip"], n["node_id"]))


def scrape_targets(base: str, timeout_s: float) -> list[str]:
    """Every node's ``ip:port`` Prometheus target (Ray's own service discovery)."""
    content = _dashboard_json(base, "/api/prometheus/sd", timeout_s)
    return [t for group in content for t in group.get("targets", [])]


def parse_series(text: str, prefix: str = "ray_mesh_") -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample in Prometheus text whose name has ``prefix``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out.append((s.name, dict(s.labels), float(s.value)))
    return out


def scrape(targets: list[str], timeout_s: float) -> tuple[list[tuple[str, dict, float]],
                                                           list[str]]:
    """All ray_mesh samples of all targets, and the targets that did not answer."""
    samples, dead = [], []
    for t in targets:
        try:
            samples += parse_series(_get(f"http://{t}/metrics", timeout_s).decode())
        except Exception:  # noqa: BLE001 - one silent node must not hide the others
            dead.append(t)
    return samples, dead


LATEST = {
    "ray_mesh_step": "step",
    "ray_mesh_step_seconds": "step_s",
    "ray_mesh_samples_per_second": "samples/s",
    "ray_mesh_tokens_per_second": "tokens/s",
    "ray_mesh_loss": "loss",
    "ray_mesh_process_rss_bytes": "rss_MB",
}
WAITS = {"ray_mesh_compute_seconds": "compute_s", "ray_mesh_wait_window_seconds": "window_s"}
RAW = ("wait_s/", "compute_s", "window_s")  # for the analysis; the table shows wait%(dim)


def latest_by_rank(samples: list[tuple[str, dict, float]], run: str) -> dict[int, dict]:
    """rank -> {column: value} from the samples tagged with ``run``."""
    out: dict[int, dict[str, float]] = {}
    for name, labels, value in samples:
        if labels.get("run") != run or not labels.get("rank", "").isdigit():
            continue
        row = out.setdefault(int(labels["rank"]), {})
        if name in LATEST:
            row[LATEST[name]] = value / 2**20 if name.endswith("rss_bytes") else value
        elif name == "ray_mesh_collective_fraction":
            row[f"coll%({labels.get('dim')})"] = 100 * value
        elif name == "ray_mesh_dim_wait_seconds":
            row[f"wait_s/{labels.get('dim')}"] = value
        elif name in WAITS:
            row[WAITS[name]] = value
    for row in out.values():
        if row.get("window_s"):
            row.update({f"wait%({k[7:]})": 100 * v / row["window_s"] for k, v in list(
                row.items()) if k.startswith("wait_s/")})
    return out


def _layout_from_state(run: dict[str, Any]) -> list[dict[str, Any]]:
    """Layout rows from the Train state's workers and the mesh spec (no interfaces)."""
    attempts = run.get("attempts") or []
    workers = attempts[-1].get("workers", []) if attempts else []
    if not workers:
        return []
    mesh = (run["run_settings"]["backend_config"].get("config") or {}).get("mesh")
    nodes = sorted({w.get("node_rank", 0) for w in workers})
    try:
        spec = MeshSpec.from_dict(mesh).resolve(len(workers), num_nodes=len(nodes))
    except Exception:  # noqa: BLE001 - show placement without coordinates
        spec = None
    rows = []
    for w in sorted(workers, key=lambda w: w["world_rank"]):
        row = {"rank": w["world_rank"], "node": w.get("node_rank", ""),
               "node_ip": w.get("node_ip", ""), "local_rank": w.get("local_rank", ""),
               "device": "cuda" if w.get("gpu_ids") else "cpu", "interface": "?"}
        coord = spec.coordinate(w["world_rank"]) if spec else {}
        row.update({d: coord.get(d, "") for d in DIM_NAMES})
        rows.append(row)
    return rows


def collect(address: str | None = None, *, timeout_s: float = 5.0,
            all_runs: bool = False) -> ClusterStatus:
    """Ask the cluster at ``address`` for its nodes and ray_mesh runs (bounded)."""
    _enable_token_auth()
    base = dashboard_url(address, timeout_s)
    status = ClusterStatus(dashboard=base, nodes=_nodes(base, timeout_s))
    try:
        data = _dashboard_json(base, "/api/train/v2/runs/v1", timeout_s)
    except StatusError as exc:
        if "STATE_TRACKING" not in str(exc):
            raise
        status.notes.append("Ray Train run state is off: start drivers with "
                            "RAY_TRAIN_ENABLE_STATE_TRACKING=1 to list runs here.")
        data = {"train_runs": []}
    runs = [r for r in data.get("train_runs", [])
            if "mesh" in ((r.get("run_settings") or {}).get("backend_config") or {}).get(
                "config", {}) and (all_runs or r.get("status") in ACTIVE)]
    samples: list[tuple[str, dict, float]] = []
    if runs:
        try:
            samples, dead = scrape(scrape_targets(base, timeout_s), timeout_s)
            if dead:
                status.notes.append(f"metrics endpoints not answering: {', '.join(dead)}")
        except StatusError as exc:
            status.notes.append(f"no metrics: {exc}")
    for r in sorted(runs, key=lambda r: r.get("start_time_ns", 0), reverse=True):
        rc = r["run_settings"]["run_config"]
        doc = read_layout(rc.get("storage_path") or "", r["name"])
        rows = doc["ranks"] if doc else _layout_from_state(r)
        metrics = latest_by_rank(samples, r["name"])
        ranks = [{**row, **metrics.get(int(row["rank"]), {})} for row in rows]
        status.runs.append({
            "name": r["name"], "id": r["id"], "status": r["status"],
            "started": _dt.datetime.fromtimestamp(r["start_time_ns"] / 1e9,
                                                  _dt.timezone.utc).strftime("%H:%M:%S UTC"),
            "mesh": doc["mesh"] if doc else str(
                r["run_settings"]["backend_config"]["config"]["mesh"]),
            "layout_source": "run dir" if doc else "train state",
            "ranks": ranks,
            "slow": analyze_run(ranks, samples, r["name"]).to_json(),
        })
    return status


# ----------------------------------------------------------------------------- output
LAYOUT_COLUMNS = ["rank", "node", "node_ip", "interface", "device", *DIM_NAMES]


def format_status(status: ClusterStatus) -> str:
    out = [f"Ray dashboard: {status.dashboard}", "", f"Nodes ({len(status.nodes)}):",
           text_table([{**n, "node_id": n["node_id"][:12]} for n in status.nodes],
                 ["node_id", "ip", "state", "head", "CPU", "GPU"])]
    if not status.runs:
        out += ["", "No running ray_mesh runs."]
    for run in status.runs:
        out += ["", f"Run {run['name']}  [{run['status']}]  started {run['started']}  "
                    f"id {run['id'][:12]}  mesh {run['mesh']}  (layout from "
                    f"{run['layout_source']})"]
        metric_cols = sorted({k for r in run["ranks"] for k in r if not k.startswith(RAW)}
                             - set(LAYOUT_COLUMNS) - {"hostname", "node_id", "local_rank"},
                             key=lambda c: (list(LATEST.values()) + [c]).index(c))
        if run["ranks"]:
            out.append(text_table(run["ranks"], LAYOUT_COLUMNS + metric_cols))
        if not metric_cols:
            out.append("(no step metrics yet: they appear ~10-20 s after the first "
                       "StepMeter flush)")
        if run.get("slow"):
            out += ["Slowest rank per dim, links, verdict:",
                    *format_analysis(run["slow"])]
    out += [f"note: {n}" for n in status.notes]
    return "\n".join(out)


__all__ = ["ClusterStatus", "StatusError", "collect", "dashboard_url", "format_status",
           "latest_by_rank", "parse_series", "scrape"]
