"""``ray-mesh status``'s replica-groups lines: the file the driver writes, read back checked."""

from __future__ import annotations

import json

import pytest

from ray_mesh.errors import Malformed
from ray_mesh.observability import replica_groups as rgf


def _status() -> dict:
    return {"live": [0, 2], "step": 41, "finished": False,
            "shares": {0: {"ranks": 2, "samples": 22, "samples_per_s": 14.25},
                       2: {"ranks": 1, "samples": 10, "samples_per_s": None}},
            "layouts": {0: "dp_shard=2", 2: "dp_shard=1"},
            "events": [
        {"kind": "joined", "group": 1, "step": 0, "detail": "3 group(s) now", "t": 1.0},
        {"kind": "left", "group": 1, "step": 7, "detail": "stopped beating", "t": 2.0}]}


def test_the_file_round_trips_into_status_lines(tmp_path):
    rgf.write(tmp_path / "run-g0", _status())
    data = (tmp_path / "run-g0" / rgf.GROUPS_JSON).read_bytes()
    lines = rgf.lines(rgf.parse(data, "f"))
    assert lines[0] == "Replica groups: live 0, 2 at step 41"
    assert lines[1] == ("  group 0 (dp_shard=2): 2 rank(s), 22 samples per segment (69%), "
                        "14.2 samples/s")
    assert lines[2] == ("  group 2 (dp_shard=1): 1 rank(s), 10 samples per segment (31%), "
                        "speed not measured yet")
    assert lines[4] == "  step 7: group 1 left (stopped beating)"


def test_a_long_event_detail_is_cut_by_the_writer_not_refused_by_the_reader(tmp_path):
    """A failed group's error is the user's text, of any length; the file keeps its first
    MAX_DETAIL characters and stays readable (the console has the whole line)."""
    status = _status()
    status["events"].append({"kind": "failed", "group": 0, "step": 9, "t": 3.0,
                             "detail": "RuntimeError: " + "x" * 1000})
    rgf.write(tmp_path / "run-g0", status)
    doc = rgf.parse((tmp_path / "run-g0" / rgf.GROUPS_JSON).read_bytes(), "f")
    detail = doc["events"][-1]["detail"]
    assert len(detail) == rgf.MAX_DETAIL and detail.startswith("RuntimeError: xxx") \
        and detail.endswith("...")
    assert doc["events"][0]["detail"] == "3 group(s) now"


def test_the_html_view_shows_each_groups_layout_speed_and_share(tmp_path):
    from ray_mesh.status.html import groups_html

    rgf.write(tmp_path / "run-g0", _status())
    page = groups_html(rgf.parse((tmp_path / "run-g0" / rgf.GROUPS_JSON).read_bytes(), "f"))
    rows = page.split("<tr>")[2:]
    assert "<td>0</td><td>dp_shard=2</td><td>2</td><td>14.2</td><td>22</td>" in rows[0]
    assert "69%" in rows[0] and "width:69px" in rows[0]
    assert "<td>2</td><td>dp_shard=1</td><td>1</td><td>-</td><td>10</td>" in rows[1]
    assert "31%" in rows[1]


@pytest.mark.parametrize("doc, why", [
    ({"live": [0]}, "not a replica-groups file"),
    ({"live": ["x"], "events": []}, "live group"),
    ({"live": [], "events": [{"kind": "left", "group": -1, "step": 0}]}, "group"),
    ({"live": [], "events": [{"kind": "x" * 100, "group": 0, "step": 0}]}, "kind"),
    ({"live": [], "events": [], "shares": []}, "shares is not a mapping"),
    ({"live": [], "events": [], "shares": {"0": {"ranks": 1, "samples": -3}}}, "samples"),
    ({"live": [], "events": [], "shares": {"0": {"ranks": 1, "samples": 3,
                                                 "samples_per_s": "fast"}}}, "samples_per_s"),
    ({"live": [], "events": [], "shares": {"-1": {"ranks": 1, "samples": 3}}}, "shares group"),
    ({"live": [], "events": [], "shares": {"0": {"ranks": 1, "samples": 3,
                                                 "layout": "<b>" * 30}}}, "layout"),
])
def test_a_hostile_file_is_refused_with_the_field_named(doc, why):
    with pytest.raises(Malformed, match=why):
        rgf.parse(json.dumps(doc).encode(), "f")


BIG = "9" * 5000  # over Python's 4300-digit int() limit
DEEP = "[" * 30_000 + "]" * 30_000
SHARE = '"0": {"ranks": 1, "samples": 3, "samples_per_s": '


def _doc(rest: str) -> str:
    return '{"live": [], "events": [], ' + rest + "}"


HOSTILE_FILES = {
    "5000-digit-share-key": _doc('"shares": {"' + BIG + '": {}}'),
    "superscript-share-key": _doc('"shares": {"\\u00b2": {}}'),
    "400-digit-speed": _doc('"shares": {' + SHARE + "9" * 400 + "}}"),
    "5000-digit-step": _doc('"step": ' + BIG),
    "4000-digit-step": _doc('"step": ' + "9" * 4000),
    "30000-deep-array": _doc('"step": ' + DEEP),
    "deep-detail": '{"live": [], "events": [{"kind": "left", "group": 0, "step": 0, '
                   '"detail": ' + "[" * 900 + "]" * 900 + "}]}",
}


@pytest.mark.parametrize("text", HOSTILE_FILES.values(), ids=HOSTILE_FILES.keys())
def test_hostile_numbers_and_nesting_are_malformed_in_one_short_message(text):
    """Before, these escaped the parser as ValueError or OverflowError (and a 4000-digit
    step was printed whole): ``ray-mesh status`` crashed on the file a cluster wrote."""
    with pytest.raises(Malformed) as err:
        rgf.parse(text.encode(), "f")
    assert len(str(err.value)) < 300, str(err.value)[:400]


def test_a_run_in_a_bucket_gets_its_groups_file_there_and_status_reads_it(monkeypatch):
    """A home lab's tailnet has no shared directory: the run's storage is a bucket, and the
    driver's groups file goes there (it was written to local storage only, so
    ``ray-mesh status --storage s3://...`` showed no groups for such a run)."""
    from moto_s3 import S3Server

    from ray_mesh.observability.layout import read_run_file
    from ray_mesh.raytrain.replica_groups import _write_status

    s3 = S3Server(bucket="groups-status")
    try:
        for k, v in s3.credentials.items():
            monkeypatch.setenv(k, v)
        _write_status(s3.uri("lab"), "lab", 2, _status(), s3.endpoint)
        for gid in (0, 1):
            got = read_run_file(s3.uri("lab"), f"lab-g{gid}", rgf.GROUPS_JSON, rgf.parse,
                                10.0, 1 << 20, s3.endpoint)
            assert rgf.lines(got)[0] == "Replica groups: live 0, 2 at step 41", got
    finally:
        s3.stop()


def test_a_bucket_out_of_reach_costs_the_driver_one_bounded_try_and_a_warning(caplog):
    import time

    from ports import free_port

    from ray_mesh.raytrain.replica_groups import _write_status

    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="ray_mesh.raytrain.replica_groups"):
        _write_status("s3://gone/lab", "lab", 3, _status(), f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - t0 < 3 * rgf.WRITE_TIMEOUT_S
    assert [r.message for r in caplog.records if "status file not written" in r.message]
