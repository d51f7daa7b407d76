"""The metrics half of ``ray-mesh status``: every node's ray_mesh series, read bounded.

Targets come from the dashboard's Prometheus service discovery, already narrowed to the
cluster's own node IPs (:func:`ray_mesh.observability.status_input.targets_of`). Each page
is read a few at a time, each within its timeout and byte cap
(:func:`ray_mesh.observability.fetch.http_get`, no credentials sent), parsed, and every
sample checked (:func:`~ray_mesh.observability.status_input.clean_samples`) before the
status table or the slow-rank analysis sees it.
"""

from __future__ import annotations

import concurrent.futures
import re

from ray_mesh.core.safe import safe_text
from ray_mesh.observability import status_input as si
from ray_mesh.observability.fetch import Deadline, SourceError, http_get

METRICS_MAX_BYTES = 8 * 2**20  # one node's Prometheus page (Ray's: well under 1 MiB)
SCRAPE_THREADS = 4


# One sample line of Prometheus' text format: name, {labels} (greedy: a label value may hold
# a brace, the value may not), value, optional timestamp.
_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+([^ \t]+)"
                     r"(?:[ \t]+-?[0-9]+)?[ \t]*")
_LABEL = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"'
                    r"[ \t]*(?:,|$)")
_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"\\": "\\", "n": "\n", '"': '"'}


def _unescape(m: re.Match[str]) -> str:
    return _ESCAPES.get(m.group(1), m.group(0))


def _sample(line: str, number: int) -> tuple[str, dict, float]:
    m = _SAMPLE.fullmatch(line)
    if m is None:
        raise ValueError(f"line {number}: not a Prometheus sample: {safe_text(line, 120)}")
    name, body, raw = m.groups()
    labels: dict[str, str] = {}
    pos, end = 0, len(body or "")
    while pos < end:
        lm = _LABEL.match(body, pos)
        if lm is None or lm.end() == pos:
            raise ValueError(f"line {number}: malformed labels: {safe_text(line, 120)}")
        value = lm.group(2)
        labels[lm.group(1)] = _ESCAPE.sub(_unescape, value) if "\\" in value else value
        pos = lm.end()
    if "_" in raw:  # float() takes 1_000; Prometheus does not
        raise ValueError(f"line {number}: value {safe_text(raw, 40)!r} is not a number")
    return name, labels, float(raw)


def parse_series(text: str, prefix: str = "ray_mesh_") -> list[tuple[str, dict, float]]:
    """(name, labels, value) of every sample in Prometheus text whose name has ``prefix``.

    Only the lines of those samples are parsed (a node's page is mostly Ray's own series,
    and ``prometheus_client``'s parser spent ~0.2 ms on each sample of ~18 labels: 4 s at
    128 nodes); one of them that is not a sample line raises ValueError. Labels are
    unescaped as the format says (``\\\\``, ``\\"``, ``\\n``)."""
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        if line.startswith(prefix):
            out.append(_sample(line.rstrip("\r"), number))
    return out


def _scrape_one(target: str, timeout_s: float, deadline: Deadline | None
                ) -> list[tuple[str, dict, float]]:
    what = f"metrics endpoint {target}"
    try:
        data = http_get(f"http://{target}/metrics", timeout_s=timeout_s,
                        max_bytes=METRICS_MAX_BYTES, what=what, deadline=deadline)
    except SourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - one silent node must not hide the others
        raise SourceError(f"{what} does not answer ({type(exc).__name__}: "
                          f"{safe_text(exc, 200)})") from None
    try:
        return parse_series(data.decode("utf-8", "replace"))
    except Exception as exc:  # noqa: BLE001 - not Prometheus text
        raise SourceError(f"{what} does not serve Prometheus text ({type(exc).__name__}: "
                          f"{safe_text(exc, 200)})") from None


def scrape(targets: list[str], timeout_s: float, deadline: Deadline | None = None
           ) -> tuple[list[tuple[str, dict, float]], list[str]]:
    """The ray_mesh samples of all targets, checked (``status_input.clean_samples``); and
    for each target that could not be read, why (named, escaped). A few targets at a time,
    each bounded by ``timeout_s`` and the ``deadline``."""
    samples: list[tuple[str, dict, float]] = []
    problems: list[str] = []
    if not targets:
        return samples, problems
    with concurrent.futures.ThreadPoolExecutor(min(SCRAPE_THREADS, len(targets))) as pool:
        futures = [pool.submit(_scrape_one, t, timeout_s, deadline) for t in targets]
        for future in futures:
            try:
                samples += future.result()
            except SourceError as exc:
                problems.append(str(exc))
    clean, dropped = si.clean_samples(samples)
    if dropped:
        problems.append(f"{dropped} metric sample(s) malformed (a rank that is not a number, "
                        f"an unknown dim, a non-finite value or an oversized label): ignored")
    return clean, problems


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
    """rank -> {column: value} from the samples tagged with ``run`` (checked samples:
    ASCII-digit ranks, known dims)."""
    out: dict[int, dict[str, float]] = {}
    for name, labels, value in samples:
        rank = labels.get("rank", "")
        if labels.get("run") != run or not (rank.isascii() and rank.isdigit()):
            continue
        row = out.setdefault(int(rank), {})
        if name in LATEST:
            row[LATEST[name]] = value / 2**20 if name.endswith("rss_bytes") else value
        elif name == "ray_mesh_dim_wait_seconds":
            row[f"wait_s/{labels.get('dim')}"] = value
        elif name in WAITS:
            row[WAITS[name]] = value
    for row in out.values():
        if row.get("window_s"):
            row.update({f"wait%({k[7:]})": 100 * v / row["window_s"] for k, v in list(
                row.items()) if k.startswith("wait_s/")})
    return out
