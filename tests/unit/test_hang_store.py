"""The hang watch's store values: what ranks write passes the strict parser, what a foreign
client writes does not (sizes, types, ranks in range), and a report shows a malformed rank.

The end-to-end attack (a foreign client of a live run's store) is tests/dist/test_store_trust.py.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch.distributed as dist

from ray_mesh.observability import hang_store as hs
from ray_mesh.observability.hang import HangWatch
from ray_mesh.observability.hang_report import format_report


def _watch(rank: int = 1, world: int = 4) -> HangWatch:
    return HangWatch({}, dist.HashStore(), rank=rank, world_size=world, timeout_s=5)


def test_what_a_rank_writes_parses_back():
    watch = _watch()
    watch.members = {"dp_shard=dp": [0, 1], "tp": [1, 3]}
    watch._pending = {"dim": "tp", "op": "all_reduce", "since": 1.5}
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="blocked")  # a stack to snapshot
    other.start()
    try:
        snap = watch.snapshot()
    finally:
        stop.set()
        other.join()
    back = hs.parse_snapshot(hs.decode(hs.encode_snapshot(snap), "snap"), 1, 4)
    assert back["groups"] == {"dp_shard=dp": [0, 1], "tp": [1, 3]}
    assert back["pending"]["op"] == "all_reduce"
    # Other threads of this process (a Ray client's, the GC's) may be listed too.
    blocked = [t for t in back["threads"] if t["name"] == "blocked"]
    assert len(blocked) == 1 and blocked[0]["frames"]
    beat = hs.parse_beat(hs.decode(json.dumps({"seq": {"tp": 3}, "t": 1.0}), "beat"))
    assert beat["seq"] == {"tp": 3}
    text = "ray_mesh: collective hang: x\n  File \"a.py\", line 1\tin f \x1b[31m"
    rep = hs.parse_report(hs.decode(hs.encode_report(2, "tp", text), "report"), 4)
    assert rep["by"] == 2 and "\\x1b[31m" in rep["text"] and "\x1b" not in rep["text"]


def test_large_legitimate_values_are_trimmed_to_fit():
    frame = {"file": "/x/" + "f" * 2000, "line": 1, "func": "g", "code": "c" * 400}
    snap = {"rank": 0, "host": "h", "pid": 1, "seq": {}, "groups": {}, "stalled_s": {},
            "pending": {"dim": "d" * 900, "op": "o", "since": 0.0},
            "threads": [{"name": f"t{i}", "frames": [frame] * 200} for i in range(200)]}
    text = hs.encode_snapshot(snap)
    assert len(text.encode()) <= hs.LIMITS["snap"]
    back = hs.parse_snapshot(hs.decode(text, "snap"), 0, 2)
    assert 0 < len(back["threads"]) <= hs.MAX_THREADS
    report = "ray_mesh: collective hang\n" + "stack line\n" * 800_000 + "Hang summary: end"
    enc = hs.encode_report(0, "dp", report)
    assert len(enc.encode()) <= hs.LIMITS["report"]
    rep = hs.parse_report(hs.decode(enc, "report"), 1)
    assert rep["text"].endswith("Hang summary: end") and "bytes cut" in rep["text"]


def _snap(**change):
    snap = {"rank": 1, "host": "h", "pid": 5, "seq": {"tp": 2}, "groups": {"tp": [0, 1]},
            "stalled_s": {"tp": 3.0}, "pending": None,
            "threads": [{"name": "main", "frames": [{"file": "a.py", "line": 1, "func": "f",
                                                      "code": ""}]}]}
    snap.update(change)
    return snap


@pytest.mark.parametrize(("change", "why"), [
    ({"rank": 0}, "rank must be 1"),
    ({"rank": True}, "rank must be 1"),
    ({"groups": {"tp": [0, 9]}}, "must be an integer in [0, 2)"),
    ({"groups": {"tp": [1, 1]}}, "distinct ranks"),
    ({"seq": {"tp": -1}}, "must be an integer in [0, inf)"),
    ({"seq": {"tp": True}}, "must be an integer"),
    ({"stalled_s": {"tp": "3"}}, "finite number"),
    ({"pending": {"dim": "tp", "op": "x", "since": 0, "cmd": "rm"}}, "exactly the fields"),
    ({"threads": [{"name": "t", "frames": []}] * 65}, "at most 64"),
    ({"host": "h" * 501}, "at most 500 characters"),
    ({"evil": 1}, "exactly the fields"),
])
def test_malformed_snapshots_are_refused(change, why):
    with pytest.raises(hs.Malformed) as err:
        hs.parse_snapshot(_snap(**change), 1, 2)
    assert why in str(err.value)


def test_decode_bounds_size_and_refuses_non_json_numbers():
    with pytest.raises(hs.Malformed, match="over the 4096-byte limit for 'request'"):
        hs.decode(b"x" * 4097, "request")
    with pytest.raises(hs.Malformed, match="NaN is not a JSON number"):
        hs.parse_beat(hs.decode('{"seq": {}, "t": NaN}', "beat"))
    with pytest.raises(hs.Malformed, match="not JSON"):
        hs.decode(b"\xff\xfe", "beat")
    with pytest.raises(hs.Malformed, match=r"by \(the requesting rank\)"):
        hs.parse_request({"by": 4, "dim": "dp"}, 4)
    with pytest.raises(hs.Malformed, match="starts 'ray_mesh: collective hang'"):
        hs.parse_report({"by": 0, "dim": "dp", "text": "run this"}, 4)


def test_store_reads_warn_and_refuse():
    store = dist.HashStore()
    wire = hs.HangStore(store, rank=0, world_size=2)
    store.set("report", "ray_mesh: collective hang: plain text")
    store.set("beat/1", json.dumps({"seq": {"tp": "1"}, "t": 0}))
    store.set("snap/1", json.dumps(_snap(rank=0)))
    assert wire.report() is None and wire.beats([1]) == {1: None}
    good, bad = wire.snapshots([0, 1])
    assert good == {} and "rank must be 1" in bad[1]
    assert set(wire.warned) == {"report", "beat/1", "snap/1"}
    store.set("claim", "lots")
    assert wire.claim() is False and "claim" in wire.warned
    store.set("claim", "0")
    assert wire.claim() is True  # a sane counter: the first claimer writes the report


def test_report_lists_a_malformed_rank():
    text = format_report({}, {}, 2, 60, 75, malformed={1: "rank must be 1"})
    assert "rank 1: MALFORMED snapshot in the rendezvous store (rank must be 1)" in text
    assert "rank 0: NO ANSWER" in text


HOSTILE = {  # each escaped decode()/the parsers as ValueError, RecursionError, OverflowError
    "5000-digit-int": '{"seq": {}, "t": ' + "9" * 5000 + "}",
    "30000-deep-array": "[" * 30_000 + "]" * 30_000,
    "400-digit-seconds": '{"seq": {}, "t": ' + "9" * 400 + "}",
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_a_hostile_beat_is_malformed_not_an_exception(raw):
    store = dist.HashStore()
    wire = hs.HangStore(store, rank=0, world_size=2)
    store.set("beat/1", raw)
    assert wire.beats([1]) == {1: None}
    assert "beat/1" in wire.warned and len(wire.warned["beat/1"]) < 200


@pytest.mark.parametrize("key, raw", [("report", HOSTILE["5000-digit-int"]),
                                      ("report", HOSTILE["30000-deep-array"]),
                                      ("request", "[" * 2000 + "]" * 2000),  # 4000 B
                                      ("claim", "9" * 5000)],
                         ids=["report-digits", "report-deep", "request-deep", "claim-digits"])
def test_the_watch_thread_keeps_watching_after_a_hostile_value(key, raw, capsys):
    """A real HangWatch thread: the hostile value is warned about, and a report written
    afterwards is still picked up (before, the thread had ended on the first tick)."""
    store = dist.HashStore()
    watch = HangWatch({}, store, rank=1, world_size=4, timeout_s=5, poll_s=0.01)
    if key == "claim":
        watch._stalled_dim = lambda now: "tp"  # a hang seen: every tick reads the claim
    store.set(key, raw)
    watch.start()
    try:
        deadline = time.monotonic() + 10
        while key not in watch.wire.warned and time.monotonic() < deadline:
            time.sleep(0.01)
        assert key in watch.wire.warned and watch._thread.is_alive()
        store.set("report", hs.encode_report(0, "tp", "ray_mesh: collective hang: seen"))
        assert watch.report_ready.wait(10), watch.wire.warned
    finally:
        watch.stop()
    assert watch.report == "ray_mesh: collective hang: seen"
    assert "holds a malformed value" in capsys.readouterr().err


def test_a_grown_key_is_refused_without_being_read(monkeypatch):
    """``append`` grows a key past any limit (the server caps only one ``set`` at 8 MiB):
    before, every rank's watch read such a value whole at every poll, then refused it. The
    job's own store is read length first; checked against this torch's real TCPStore."""
    import resource
    import subprocess
    import sys

    # The server in a process of its own: answering a GET it copies the value, which must
    # not count as this process reading it.
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch.distributed as d; s = d.TCPStore("
         "'127.0.0.1', 0, is_master=True, wait_for_workers=False); print(s.port, flush=True);"
         " sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", server.stdout.readline().strip())
    store, reader = hs.connect_store(timeout_s=10), hs.connect_reader()
    wire = hs.HangStore(store, rank=0, world_size=2, reader=reader)
    assert wire.reader is reader  # this torch answers the length-first read
    try:
        wire.publish_beat({"tp": 3})
        store.set("beat/1", json.dumps({"seq": {"tp": 2}, "t": 1.0}))
        assert wire.beats([0, 1]) == {0: {"seq": {"tp": 3}, "t": wire.beats([0])[0]["t"]},
                                      1: {"seq": {"tp": 2}, "t": 1.0}}
        chunk = b" " * (8 << 20)  # JSON whitespace: a legal, 64 MiB value
        for _ in range(8):
            store.append("snap/1", chunk)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        good, bad = wire.snapshots([1])
        grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        assert good == {} and "67108864 bytes, over the 2097152-byte limit" in bad[1], bad
        assert "(not read)" in bad[1] and grew_mb < 32, grew_mb  # whole: >= 64 MB more
        for _ in range(2):
            store.append("claim", b"9" * 4096)
        assert wire.claim() is False and "not read" in wire.warned["claim"]
        assert wire.beats([1])[1]["seq"] == {"tp": 2}  # the connection is good again
    finally:
        reader.close()
        server.communicate("", timeout=30)


def test_a_store_that_does_not_answer_falls_back_to_whole_reads():
    """A reader whose probe fails (here: nothing listens) is dropped at start-up, with a
    warning, and the watch reads values whole as before."""
    from ray_mesh.observability.store_wire import BoundedReader

    wire = hs.HangStore(dist.HashStore(), rank=0, world_size=2,
                        reader=BoundedReader("127.0.0.1", 1, "p", timeout_s=2))
    assert wire.reader is None
    wire.store.set("beat/1", json.dumps({"seq": {}, "t": 1.0}))
    assert wire.beats([1])[1] == {"seq": {}, "t": 1.0}
