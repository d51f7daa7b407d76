"""The hang watch's keys in the rendezvous store, written bounded and read strictly.

The store (``MASTER_ADDR:MASTER_PORT``) has no authentication: whoever reaches the port can
write any key (docs/trust-model.md), so a rank must not adopt whatever sits under
``report`` as the run's hang report, nor parse peers' heartbeats and snapshots without a
bound. Each value is

* bounded in size (:data:`LIMITS`; a legitimate value is trimmed to fit when written),
* parsed strictly: JSON of exactly the fields ray_mesh writes, with their types, finite
  numbers and ranks in ``[0, world_size)``,

and one that fails is *malformed*: never adopted, reported once per key on the rank's log
and stderr, and listed as malformed in a hang report. A well-formed value from a foreign
client is still indistinguishable from a rank's (the store cannot authenticate): binding
the store and the firewall recipe are what keep foreign clients off it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ray_mesh.core.safe import clip, safe_text
from ray_mesh.errors import Malformed, Oversize
from ray_mesh.observability.store_wire import CHECKED_TORCH as WIRE_TORCH
from ray_mesh.observability.store_wire import BoundedReader

logger = logging.getLogger("ray_mesh.observability.hang")

KIB = 1024
LIMITS = {"beat": 64 * KIB, "request": 4 * KIB, "snap": 2048 * KIB, "report": 4096 * KIB,
          "claim": 32}
MAX_THREADS = 64
MAX_FRAMES = 48  # innermost frames kept per thread (the report shows the last 12)
MAX_TEXT = 500  # characters kept of a file name, function, code line, host, op or dim
MAX_DIMS = 64
WARN_PER_KEY = 10


# ----------------------------------------------------------------------------- checks
def _check(ok: bool, why: str) -> None:
    if not ok:
        raise Malformed(why)


def _int(v: Any, what: str, lo: int = 0, hi: int | None = None) -> int:
    _check(type(v) is int and v >= lo and (hi is None or v < hi),
           f"{what} must be an integer in [{lo}, {hi if hi is not None else 'inf'}), "
           f"got {str(v)[:40]!r}")
    return v


def _finite(v: Any) -> bool:
    """A JSON number that is a finite float: an integer of 400 digits is not (float() of it
    raises OverflowError, which would end the watch thread instead of refusing the value)."""
    try:
        return type(v) in (int, float) and math.isfinite(v)
    except OverflowError:
        return False


def _num(v: Any, what: str) -> float:
    _check(_finite(v), f"{what} must be a finite number")
    return float(v)


def _text(v: Any, what: str) -> str:
    _check(isinstance(v, str) and len(v) <= MAX_TEXT,
           f"{what} must be a string of at most {MAX_TEXT} characters")
    return v


def _fields(obj: Any, what: str, required: set[str]) -> dict:
    _check(isinstance(obj, dict), f"{what} must be a JSON object")
    _check(set(obj) == required, f"{what} must have exactly the fields {sorted(required)}, "
                                 f"got {sorted(map(str, obj))[:10]}")
    return obj


def _dim_map(v: Any, what: str, value) -> dict[str, Any]:
    _check(isinstance(v, dict) and len(v) <= MAX_DIMS, f"{what} must be an object of at most "
                                                       f"{MAX_DIMS} dims")
    return {_text(k, f"{what} key"): value(x, f"{what}[{k[:20]!r}]") for k, x in v.items()}


def _reject_constant(name: str) -> Any:
    raise Malformed(f"{name} is not a JSON number ray_mesh writes")


def decode(raw: bytes | str, kind: str) -> Any:
    """JSON of at most ``LIMITS[kind]`` bytes (NaN and Infinity refused)."""
    limit = LIMITS[kind]
    data = raw.encode() if isinstance(raw, str) else raw
    _check(len(data) <= limit, f"{len(data)} bytes, over the {limit}-byte limit for {kind!r}")
    try:  # ValueError: also an integer over Python's 4300 digits; RecursionError: nesting
        return json.loads(data.decode(), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise Malformed(f"not JSON ray_mesh writes ({type(exc).__name__}: "
                        f"{str(exc)[:80]})") from None


def parse_beat(obj: Any) -> dict[str, Any]:
    beat = _fields(obj, "a heartbeat", {"seq", "t"})
    return {"seq": _dim_map(beat["seq"], "seq", _int), "t": _num(beat["t"], "t")}


def parse_request(obj: Any, world_size: int) -> dict[str, Any]:
    req = _fields(obj, "a snapshot request", {"by", "dim"})
    return {"by": _int(req["by"], "by (the requesting rank)", 0, world_size),
            "dim": _text(req["dim"], "dim")}


def parse_report(obj: Any, world_size: int) -> dict[str, Any]:
    rep = _fields(obj, "a hang report", {"by", "dim", "text"})
    _check(isinstance(rep["text"], str) and rep["text"].startswith("ray_mesh: collective hang"),
           "text must be a report ray_mesh wrote (it starts 'ray_mesh: collective hang')")
    _check(safe_text(rep["text"], multiline=True) == rep["text"],
           "text holds control characters (terminal escapes and the like) that ray_mesh "
           "never writes")
    return {"by": _int(rep["by"], "by (the reporting rank)", 0, world_size),
            "dim": _text(rep["dim"], "dim"), "text": rep["text"]}


def _frame(v: Any, what: str) -> dict[str, Any]:
    f = _fields(v, what, {"file", "line", "func", "code"})
    _check(f["line"] is None or type(f["line"]) is int, f"{what}.line must be an integer")
    return {"file": _text(f["file"], "file"), "line": f["line"],
            "func": _text(f["func"], "func"), "code": _text(f["code"], "code")}


def _thread(v: Any, what: str) -> dict[str, Any]:
    t = _fields(v, what, {"name", "frames"})
    _check(isinstance(t["frames"], list) and len(t["frames"]) <= MAX_FRAMES,
           f"{what}.frames must be a list of at most {MAX_FRAMES} frames")
    return {"name": _text(t["name"], "name"),
            "frames": [_frame(f, f"{what} frame") for f in t["frames"]]}


def parse_snapshot(obj: Any, rank: int, world_size: int) -> dict[str, Any]:
    """A rank's snapshot (``HangWatch.snapshot``); its ``rank`` must be the key's."""
    s = _fields(obj, "a snapshot", {"rank", "host", "pid", "seq", "groups", "stalled_s",
                                    "pending", "threads"})
    _check(s["rank"] == rank and type(s["rank"]) is int,
           f"rank must be {rank} (the rank of its key), got {str(s['rank'])[:20]!r}")

    def members(v: Any, what: str) -> list[int]:
        _check(isinstance(v, list) and 0 < len(v) <= world_size and len(set(map(str, v))) ==
               len(v), f"{what} must list distinct ranks")
        return [_int(r, f"{what} rank", 0, world_size) for r in v]

    pending = s["pending"]
    if pending is not None:
        p = _fields(pending, "pending", {"dim", "op", "since"})
        pending = {"dim": _text(p["dim"], "dim"), "op": _text(p["op"], "op"),
                   "since": _num(p["since"], "since")}
    _check(isinstance(s["threads"], list) and len(s["threads"]) <= MAX_THREADS,
           f"threads must be a list of at most {MAX_THREADS}")
    return {"rank": rank, "host": _text(s["host"], "host"), "pid": _int(s["pid"], "pid"),
            "seq": _dim_map(s["seq"], "seq", _int),
            "groups": _dim_map(s["groups"], "groups", members),
            "stalled_s": _dim_map(s["stalled_s"], "stalled_s", _num), "pending": pending,
            "threads": [_thread(t, "thread") for t in s["threads"]]}


# ----------------------------------------------------------------------------- writing
def _cut(text: str) -> str:
    return clip(text, MAX_TEXT)


def trim_threads(threads: list[dict[str, Any]], frames: int = MAX_FRAMES
                 ) -> list[dict[str, Any]]:
    """Threads as the snapshot carries them: at most MAX_THREADS, innermost ``frames`` each,
    strings cut to MAX_TEXT."""
    return [{"name": _cut(t["name"]),
             "frames": [{"file": _cut(f["file"]), "line": f["line"], "func": _cut(f["func"]),
                         "code": _cut(f["code"])} for f in t["frames"][-frames:]]}
            for t in threads[:MAX_THREADS]]


def encode_snapshot(snap: dict[str, Any]) -> str:
    """The snapshot as JSON within its limit: fewer frames per thread, then fewer threads."""
    out = dict(snap)
    if snap.get("pending"):
        out["pending"] = {**snap["pending"], "dim": _cut(snap["pending"]["dim"]),
                          "op": _cut(snap["pending"]["op"])}
    for frames in (MAX_FRAMES, 12, 4, 1, 0):
        out["threads"] = trim_threads(snap["threads"], frames)
        while True:
            text = json.dumps(out)
            if len(text.encode()) <= LIMITS["snap"] or not out["threads"]:
                break
            out["threads"] = out["threads"][: len(out["threads"]) // 2]
        if len(text.encode()) <= LIMITS["snap"]:
            return text
    return text


def encode_report(by: int, dim: str, text: str) -> str:
    """The report as the store carries it; the middle is cut to fit (head and summary kept)."""
    room = LIMITS["report"] - 2 * KIB
    data = text.encode()
    if len(data) > room:
        head, tail = data[: room // 2].decode(errors="ignore"), data[-room // 4:].decode(
            errors="ignore")
        text = f"{head}\n[... {len(data) - len(head) - len(tail)} bytes cut ...]\n{tail}"
    return json.dumps({"by": by, "dim": _cut(dim), "text": safe_text(text, multiline=True)})


# ----------------------------------------------------------------------------- the store
def _endpoint(prefix: str | None) -> tuple[str, int, str]:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise RuntimeError("The hang watch needs MASTER_ADDR and MASTER_PORT (the rendezvous "
                           "store); build the mesh with ray_mesh first.")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return host, int(port), prefix or f"ray_mesh/hang/{restart}"


def connect_store(prefix: str | None = None, timeout_s: float = 30.0) -> dist.Store:
    """A client of the job's rendezvous TCPStore (MASTER_ADDR:MASTER_PORT), under a prefix.

    Under Ray each run attempt has its own MASTER_PORT; under torchrun the prefix carries
    the restart count, so a restarted job never reads an old attempt's report.
    """
    host, port, prefix = _endpoint(prefix)
    store = dist.TCPStore(host, port, is_master=False,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    return dist.PrefixStore(prefix, store)


def connect_reader(prefix: str | None = None) -> BoundedReader:
    """A reader of the same keys as :func:`connect_store` that checks a value's length
    before reading it (:mod:`ray_mesh.observability.store_wire`)."""
    return BoundedReader(*_endpoint(prefix))


class HangStore:
    """One rank's reads and writes of the watch's keys; malformed values are warned once.

    ``reader``: the store's keys read length first (:func:`connect_reader`), so a value
    over its limit is refused unread; without one (or when this torch's store does not
    answer it as expected) values are read whole with ``store.get`` and checked after.
    """

    def __init__(self, store: dist.Store, rank: int, world_size: int,
                 reader: BoundedReader | None = None) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        if reader is not None and not reader.works(store, rank):
            logger.warning("ray_mesh hang watch (rank %d): the rendezvous store did not answer "
                           "a length-first read as torch %s did; values are read whole.",
                           rank, WIRE_TORCH)
            reader = None
        self.reader = reader
        self.warned: dict[str, str] = {}  # key -> why its latest malformed value was refused
        self._last: dict[str, bytes] = {}  # key -> digest of the malformed value last warned
        self._count: dict[str, int] = {}

    def malformed(self, key: str, why: str, raw: bytes = b"") -> None:
        """Warn about a refused value: once per distinct value, at most WARN_PER_KEY per key."""
        self.warned[key] = why
        digest = hashlib.blake2b(raw, digest_size=8).digest()
        if self._last.get(key) == digest or self._count.get(key, 0) >= WARN_PER_KEY:
            return
        self._last[key] = digest
        self._count[key] = self._count.get(key, 0) + 1
        more = (" Further malformed values of this key are not shown."
                if self._count[key] == WARN_PER_KEY else "")
        message = (f"ray_mesh hang watch (rank {self.rank}): the rendezvous store's key "
                   f"{key!r} holds a malformed value ({why}); ignored. Only this job's ranks "
                   f"should write to the store: another client reaches MASTER_ADDR:"
                   f"MASTER_PORT (see docs/trust-model.md).{more}")
        logger.warning("%s", message)
        print(message, file=sys.stderr, flush=True)

    def read(self, key: str, kind: str, parse) -> Any:
        """The parsed value under ``key``; None when absent or malformed (warned)."""
        if not self.store.check([key]):
            return None
        try:
            raw = self._get(key, LIMITS[kind])
        except Oversize as exc:
            self.malformed(key, f"{exc.size} bytes, over the {LIMITS[kind]}-byte limit for "
                                f"{kind!r} (not read)", f"{key} {exc.size}".encode())
            return None
        try:
            value = parse(decode(raw, kind))
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # Malformed is a ValueError; anything else a hostile value provokes in a parser
            # is refused the same way: an exception here would end the watch thread.
            why = str(exc) if isinstance(exc, Malformed) else (
                f"{type(exc).__name__}: {str(exc)[:80]}")
            self.malformed(key, why, raw)
            return None
        self.warned.pop(key, None)
        return value

    def _get(self, key: str, limit: int) -> bytes:
        """The value, length first where a reader is set (:class:`Oversize` over ``limit``)."""
        return self.reader.get(key, limit) if self.reader is not None else self.store.get(key)

    def beats(self, ranks: Any) -> dict[int, dict[str, Any] | None]:
        return {r: self.read(f"beat/{r}", "beat", parse_beat) for r in ranks}

    def snapshots(self, ranks: Any) -> tuple[dict[int, dict[str, Any]], dict[int, str]]:
        """(rank -> snapshot, rank -> why its value is malformed) of the ranks that wrote."""
        good, bad = {}, {}
        for r in ranks:
            key = f"snap/{r}"
            snap = self.read(key, "snap", lambda o, r=r: parse_snapshot(o, r, self.world_size))
            if snap is not None:
                good[r] = snap
            elif key in self.warned:
                bad[r] = self.warned[key]
        return good, bad

    def request(self) -> dict[str, Any] | None:
        return self.read("request", "request", lambda o: parse_request(o, self.world_size))

    def report(self) -> str | None:
        rep = self.read("report", "report", lambda o: parse_report(o, self.world_size))
        return rep["text"] if rep else None

    def publish_beat(self, seq: dict[str, int]) -> None:
        self.store.set(f"beat/{self.rank}", json.dumps({"seq": seq, "t": time.time()}))

    def send_snapshot(self, snap: dict[str, Any]) -> None:
        self.store.set(f"snap/{self.rank}", encode_snapshot(snap))

    def send_request(self, dim: str) -> None:
        self.store.set("request", json.dumps({"by": self.rank, "dim": _cut(dim)}))

    def send_report(self, dim: str, text: str) -> None:
        self.store.set("report", encode_report(self.rank, dim, text))

    def claim(self) -> bool:
        """True for the one rank that writes the report. The counter is read first without
        changing it (``add`` on a non-integer makes torch's server drop the connection)."""
        if self.reader is not None and self.store.check(["claim"]):
            try:  # compare_set answers with the whole value: its length is checked first
                self.reader.get("claim", LIMITS["claim"])
            except Oversize as exc:
                self.malformed("claim", f"{exc.size} bytes, not a count of ranks (not read)",
                               f"claim {exc.size}".encode())
                return False
        now = self.store.compare_set("claim", "", "0")
        now = now.decode(errors="replace") if isinstance(now, bytes) else str(now)
        if not (len(now) <= LIMITS["claim"] and now.isascii() and now.isdigit()
                and int(now) <= self.world_size):  # int() of 5000 digits raises
            self.malformed("claim", f"{now[:40]!r} is not a count of ranks 0..{self.world_size}",
                           now.encode())
            return False
        return self.store.add("claim", 1) == 1
