"""The doctor's path MTU probe on this machine's loopback, and the relayed-link verdict.

The blackhole and the slow pair on a real tunnel: tests/netns/test_doctor_paths.py."""

from __future__ import annotations

import pytest

from ray_mesh.network.links import Link, LinkMatrix
from ray_mesh.network.mtu import MtuReport, PathMtu, measure_path_mtu


def test_loopback_paths_carry_a_whole_ip_packet_both_ways():
    report = measure_path_mtu(["127.0.0.1", "127.0.0.2"], lambda _i, fn, *a: fn(*a))
    assert {(p.a, p.b, p.mtu) for p in report.paths} == {
        ("127.0.0.1", "127.0.0.2", 65535), ("127.0.0.2", "127.0.0.1", 65535)}
    assert report.problems() == [] and report.blackholes() == []


def test_a_stranger_gets_no_answer_from_the_echo():
    """Only the run's nodes are answered: a prober from another address reads nothing."""
    report = measure_path_mtu(["127.0.0.1"], lambda _i, fn, *a: fn(*a))
    assert report.paths == []  # one node: nothing to probe
    from ray_mesh.network.mtu import probe_paths, start_echo, stop_echo

    port = start_echo("127.0.0.1", "n" * 32, 10.0, ["127.0.0.1"])
    try:
        got = probe_paths("127.0.0.3", [("127.0.0.1", port)], "n" * 32, probe_s=0.1)
        assert got[0]["mtu"] == 0, got
    finally:
        stop_echo(port)


def test_blackhole_lines_name_the_direction_sizes_and_fix():
    text = "\n".join(MtuReport([PathMtu("100.64.0.1", "100.64.0.2", 1232, 1280,
                                        "tailscale0")]).problems())
    assert "MTU blackhole 100.64.0.1 -> 100.64.0.2: packets over 1232 bytes" in text
    assert "`ping -M do -s 1252 100.64.0.2`" in text and "-s 1204" in text
    assert "sudo ip link set tailscale0 mtu 1232" in text


def _matrix(*rates: tuple[str, str, float]) -> LinkMatrix:
    return LinkMatrix([Link(a, b, r) for a, b, r in rates])


def test_one_far_slower_link_is_named_as_probably_relayed():
    m = _matrix(("a", "b", 300), ("a", "c", 280), ("b", "c", 2.0))
    assert [(x.a, x.b) for x, _ in m.relayed()] == [("b", "c")]
    hint = m.relay_hints()[0]
    assert "link b <-> c: 2.0 Mbit/s, 145x slower" in hint
    assert "`tailscale ping c`" in hint and "`tailscale status`" in hint
    assert "probably relayed" in m.format()


@pytest.mark.parametrize("rates", [
    [("a", "b", 2.0)],  # one link: nothing to compare with
    [("a", "b", 300), ("a", "c", 2.0)],  # two links: still too few
    [("a", "b", 300), ("a", "c", 200), ("b", "c", 100)],  # uneven, none far slower
])
def test_no_relay_verdict_without_a_clear_outlier(rates):
    assert _matrix(*rates).relayed() == []
