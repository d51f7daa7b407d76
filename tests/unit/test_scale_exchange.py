"""benchmarks/scale_exchange.py's arithmetic: the fit, the bytes each path sends, and the
projection to 125M / 1B / 8B parameters (the measurement itself is the benchmark's run)."""

from __future__ import annotations

import pytest

from benchmarks import scale_exchange as se
from ray_mesh.parallel.compress import CHUNK


def test_fit_recovers_a_line():
    fixed, per = se.fit([(x, 0.5 + 2e-9 * x) for x in (1e6, 4e6, 16e6, 64e6)])
    assert fixed == pytest.approx(0.5) and per == pytest.approx(2e-9)


def test_wire_bytes_of_each_path():
    assert se.wire_bytes("heal", 100.0, 3) == 100.0  # the donor sends to the one healer
    assert se.wire_bytes("heal", 100.0, 3, healers=2) == 200.0
    assert se.wire_bytes("heal_2donors", 100.0, 3) == 50.0  # each donor half of it
    assert se.wire_bytes("exchange", 300.0, 3) == pytest.approx(400.0)  # ring: 2(m-1)/m
    assert se.wire_bytes("exchange", 300.0, 2) == pytest.approx(300.0)
    assert se.wire_bytes("exchange_int8", 400.0, 3) == pytest.approx(
        100.0 * (1 + 4 / CHUNK) * 2)  # codes and scales to each other member


def test_projection_adds_the_tunnel_to_the_fit():
    fits = {p: (0.01, 1e-9) for p in se.PATHS}
    got = se.project(fits, 3, mbit=100.0)
    big = got["8B"]
    assert big["leader_bytes"] == 64e9 and big["heal"]["payload_bytes"] == 96e9
    heal = big["heal"]
    assert heal["loopback_s"] == pytest.approx(0.01 + 96.0, rel=1e-6)
    assert heal["tunnel_s"] == pytest.approx(heal["loopback_s"] + 96e9 * 8 / 100e6, abs=0.1)
    assert got["125M"]["exchange_int8"]["sent_bytes"] < got["125M"]["exchange"]["sent_bytes"]
    two = big["heal_2donors"]  # half the bytes up each donor's link, the whole payload in
    assert two["sent_bytes"] == 48e9 and two["tunnel_s"] == pytest.approx(
        two["loopback_s"] + 48e9 * 8 / 100e6, abs=0.1)
    assert two["tunnel_s_symmetric"] == pytest.approx(two["loopback_s"] + 96e9 * 8 / 100e6,
                                                      abs=0.1)
    assert heal["tunnel_s_symmetric"] == heal["tunnel_s"]
    assert se.project(fits, 3, mbit=None)["1B"]["exchange"]["tunnel_s"] is None
