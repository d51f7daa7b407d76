"""A driver on a busy head: its Ray dashboard answers the state API, but only after seconds.

Run as a script by tests/ray/test_state_api_busy.py. It starts a local Ray of its own with
the dashboard, then puts a slow proxy in front of that dashboard on the address the driver's
state API probe asks (``RAY_API_SERVER_ADDRESS``, Ray's own setting for that address; set in
this process only, after ``ray.init``, so Ray's own actors keep the real dashboard). Every
request through the proxy waits ``DELAY_S`` before it is forwarded: a head too busy to answer
within the probe's 3 s. Then one ``MeshConfig`` fit, and what ``ray-mesh status`` reads
(``ray_mesh.status.cluster.collect``, from the real dashboard). Prints one JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import ray

DELAY_S = 5.0
RUN = "busyhead"


def slow_proxy(target: str) -> ThreadingHTTPServer:
    hits: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            time.sleep(DELAY_S)
            headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
            req = urllib.request.Request(target + self.path, headers=headers)
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, body, ctype = r.status, r.read(), r.headers.get("Content-Type")
            except urllib.error.HTTPError as e:
                status, body, ctype = e.code, e.read(), e.headers.get("Content-Type")
            try:
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the probe gave up on us: that is the point

        def log_message(self, *args: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    srv.daemon_threads = True
    srv.hits = hits  # type: ignore[attr-defined]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def train_loop(config: dict) -> None:
    import ray_mesh

    for step in range(3):
        ray_mesh.report({"step": step})


def main() -> None:
    from ports import free_port

    import ray_mesh
    from ray_mesh.status.cluster import collect

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname} {record.getMessage()}")
            print("LOG", record.levelname, record.getMessage(), flush=True)

    logging.getLogger("ray_mesh").addHandler(Keep())
    logging.getLogger("ray_mesh").setLevel(logging.INFO)
    tmp = tempfile.mkdtemp(prefix="rmbh_", dir="/tmp")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pypath = os.pathsep.join([repo, os.path.dirname(os.path.abspath(__file__))])
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=True,
                   dashboard_host="127.0.0.1", dashboard_port=free_port(), _temp_dir=tmp,
                   runtime_env={"env_vars": {"PYTHONPATH": pypath}, "worker_process_setup_hook":
                                "ray_mesh.raytrain.driver.embedded_worker_setup"})
    proxy = slow_proxy(f"http://{ctx.dashboard_url}")
    os.environ["RAY_API_SERVER_ADDRESS"] = f"http://127.0.0.1:{proxy.server_port}"
    os.environ.pop("RAY_TRAIN_ENABLE_STATE_TRACKING", None)

    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    t0 = time.monotonic()
    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=1),
                 torch_config=ray_mesh.MeshConfig(measure_links=False),
                 run_config=RunConfig(name=RUN, storage_path=f"{tmp}/results")).fit()
    fit_s = time.monotonic() - t0
    deadline = time.monotonic() + 30  # the background retry answers through the proxy
    while time.monotonic() < deadline and not any("answers now" in m for m in lines):
        time.sleep(0.5)
    status = collect(ctx.address_info["gcs_address"], all_runs=True, timeout_s=15, total_s=40)
    print("RESULT " + json.dumps({
        "tracking_env": os.environ.get("RAY_TRAIN_ENABLE_STATE_TRACKING"),
        "lines": lines, "proxy_hits": len(proxy.hits), "fit_s": round(fit_s, 1),
        "runs": [{"name": r.get("name"), "status": r.get("status")} for r in status.runs],
        "notes": status.notes}), flush=True)
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
