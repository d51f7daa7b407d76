"""The replica groups of a run, as ``ray-mesh status`` shows them: who is live, each group's
share of a step's samples and its measured speed, and each group leaving, joining and
healing with the step at which it happened.

The driver of a replica-group run (:func:`ray_mesh.raytrain.replica_groups.fit_replica_groups`)
writes ``ray_mesh_replica_groups.json`` into every group's run directory (a local or shared
directory, or the run's bucket) as the coordinator records events; ``ray-mesh status``
reads it next to the layout file, from storage the viewer named, and checks every field
(:func:`parse`) before showing it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ray_mesh.core.files import write_atomic
from ray_mesh.core.object_store import filesystem, is_uri
from ray_mesh.core.safe import clip
from ray_mesh.errors import Malformed
from ray_mesh.observability import status_input as si
from ray_mesh.observability.fetch import Deadline, SourceError
from ray_mesh.observability.layout import named_storage, read_run_file

GROUPS_JSON = "ray_mesh_replica_groups.json"
MAX_EVENTS = 50  # the newest; a long run's history is in the driver's console
MAX_GROUPS = 1024
MAX_STEP = 2**62
# An event's detail as the file keeps it: the reader refuses a longer one, so the writer
# cuts it (the driver's console has the whole line); a failed group's error is the
# user's text, of any length.
MAX_DETAIL = 300
WRITE_TIMEOUT_S = 5.0  # each request of a write to a bucket (the driver's loop waits on it)


def document(status: dict[str, Any]) -> dict[str, Any]:
    """The file's content from the coordinator's status."""
    return {"live": list(status["live"]), "step": int(status["step"]),
            "finished": bool(status["finished"]),
            "shares": {str(g): {**s, "layout": status.get("layouts", {}).get(g, "")}
                       for g, s in status.get("shares", {}).items()},
            "events": [{**{k: e[k] for k in ("kind", "group", "step")},
                        "detail": clip(str(e["detail"]), MAX_DETAIL)}
                       for e in status["events"][-MAX_EVENTS:]]}


def write(run_dir: str | os.PathLike, status: dict[str, Any], endpoint: str | None = None,
          timeout_s: float = WRITE_TIMEOUT_S) -> None:
    """Write the file into a run directory, whole or not at all: a local (or shared) path,
    or a URI (an ``s3://`` bucket at ``endpoint``: one object, each request bounded by
    ``timeout_s``; a home lab's tailnet has no shared directory)."""
    if is_uri(str(run_dir)):
        fs, root = filesystem(str(run_dir), endpoint, timeout_s=timeout_s, retries=0)
        with fs.open_output_stream(f"{root}/{GROUPS_JSON}") as out:  # one PUT: whole or none
            out.write(json.dumps(document(status)).encode())
        return
    path = Path(run_dir)
    path.mkdir(parents=True, exist_ok=True)
    write_atomic(path / GROUPS_JSON, json.dumps(document(status)))


def parse(data: bytes, what: str) -> dict[str, Any]:
    """The file, checked: group ids and steps are integers, texts are bounded."""
    doc = si.load_json(data, what)
    if not isinstance(doc, dict) or not isinstance(doc.get("events"), list) \
            or not isinstance(doc.get("live"), list):
        raise Malformed(f"{what} is not a replica-groups file (no live or events list)")
    if len(doc["live"]) > MAX_GROUPS:
        raise Malformed(f"{what} lists more than {MAX_GROUPS} live groups")
    events = []
    for i, e in enumerate(doc["events"][-MAX_EVENTS:]):
        if not isinstance(e, dict):
            raise Malformed(f"{what}: event {i} is not an object")
        events.append({"kind": si.text(e.get("kind"), f"{what}: event {i}: kind", 16),
                       "group": si.integer(e.get("group"), f"{what}: event {i}: group"),
                       "step": si.integer(e.get("step"), f"{what}: event {i}: step",
                                          high=MAX_STEP),
                       "detail": si.text(e.get("detail", ""), f"{what}: event {i}: detail",
                                         MAX_DETAIL)})
    return {"live": [si.integer(g, f"{what}: live group") for g in doc["live"]],
            "step": si.integer(doc.get("step", 0), f"{what}: step", high=MAX_STEP),
            "finished": bool(doc.get("finished", False)), "events": events,
            "shares": _shares(doc.get("shares", {}), what)}


def _shares(raw: Any, what: str) -> dict[int, dict[str, Any]]:
    if not isinstance(raw, dict) or len(raw) > MAX_GROUPS:
        raise Malformed(f"{what}: shares is not a mapping of at most {MAX_GROUPS} groups")
    out = {}
    for key, s in raw.items():
        # JSON keys are text; int() of "²" or of 5000 digits raises, so only short ASCII
        # digits are read as a number (anything else is refused as not an integer).
        digits = isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 18
        gid = si.integer(int(key) if digits else key, f"{what}: shares group")
        if not isinstance(s, dict):
            raise Malformed(f"{what}: shares of group {gid} is not an object")
        speed = s.get("samples_per_s")
        out[gid] = {"ranks": si.integer(s.get("ranks"), f"{what}: group {gid} ranks"),
                    "samples": si.integer(s.get("samples"), f"{what}: group {gid} samples",
                                          high=MAX_STEP),
                    "samples_per_s": None if speed is None else
                    si.number(speed, f"{what}: group {gid} samples_per_s"),
                    "layout": si.text(s.get("layout", ""), f"{what}: group {gid} layout", 64)}
    return out


def read(run: dict[str, Any], storage: list[str] | tuple[str, ...], timeout_s: float,
         max_bytes: int, endpoint: str | None = None, deadline: Deadline | None = None
         ) -> tuple[dict[str, Any] | None, str | None]:
    """A run's replica-groups file from storage the viewer named: (checked file or None
    when there is none, why it could not be used)."""
    named = named_storage(run["storage_raw"], storage) if run["storage_raw"] else None
    if named is None or not si.safe_component(run["name"]):
        return None, None  # read_run_layout already said why, once
    try:
        return read_run_file(named, run["name"], GROUPS_JSON, parse, timeout_s, max_bytes,
                             endpoint, deadline), None
    except (Malformed, SourceError) as exc:
        return None, f"run {run['name']}: replica-groups file not used ({exc})"


def lines(groups: dict[str, Any]) -> list[str]:
    """The status printout's lines for one run."""
    live = ", ".join(str(g) for g in groups["live"]) or "none"
    out = [f"Replica groups: live {live} at step {groups['step']}"
           + ("  (run finished)" if groups["finished"] else "")]
    shares = groups.get("shares", {})
    total = sum(s["samples"] for s in shares.values()) or 1
    for gid, s in sorted(shares.items()):
        speed = (f", {s['samples_per_s']:.1f} samples/s" if s["samples_per_s"] is not None
                 else ", speed not measured yet")
        layout = f" ({s['layout']})" if s.get("layout") else ""
        out.append(f"  group {gid}{layout}: {s['ranks']} rank(s), {s['samples']} samples per "
                   f"segment ({100 * s['samples'] / total:.0f}%){speed}")
    out += [f"  step {e['step']}: group {e['group']} {e['kind']} ({e['detail']})"
            for e in groups["events"]]
    return out
