"""The cross-group link's bounded waits (ray_mesh.replicas.link), on real gloo groups.

Members are threads of this process, each with its own ``CrossLink`` on one TCP store. A
member that never comes (it failed after the quorum named it) or stops in the middle of a
collective (its node went away, no socket closed) must not hold the others for the link's
timeout once the quorum knows it is gone: the ``abort`` check ends the wait.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from ray_mesh.replicas.link import (
    POLL_S,
    CrossLink,
    LinkAbandoned,
    compressed_weighted_mean,
    weighted_mean,
)
from ray_mesh.replicas.link_store import serve_store

TIMEOUT_S = 20.0  # the link's own bound: every wait below must end long before it


@pytest.fixture
def store():
    s, address = serve_store("127.0.0.1")  # as the coordinator serves it
    yield address


def _link(store, timeout_s: float = TIMEOUT_S) -> CrossLink:
    host, port, key = store
    return CrossLink(host, port, 0, timeout_s, key=key)


def _later(seconds: float) -> threading.Event:
    flag = threading.Event()
    threading.Timer(seconds, flag.set).start()
    return flag


def _pair(store, epoch: int) -> tuple[CrossLink, CrossLink, list]:
    links, groups = [_link(store), _link(store)], [None, None]

    def build(i: int) -> None:
        groups[i] = links[i].group(epoch, i, 2, lambda: False)

    threads = [threading.Thread(target=build, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert all(g is not None for g in groups)
    return links[0], links[1], groups


def test_a_member_that_never_joins_the_rendezvous_ends_the_wait_on_abort(store):
    link, gone = _link(store), _later(0.5)
    t0 = time.monotonic()
    with pytest.raises(LinkAbandoned, match="epoch 3"):
        link.group(3, 0, 2, gone.is_set)
    assert time.monotonic() - t0 < 0.5 + 3 * POLL_S
    link.forget()


def test_a_member_silent_in_a_collective_ends_the_wait_on_abort(store):
    a, _b, groups = _pair(store, 1)
    gone = _later(0.5)
    t0 = time.monotonic()
    with pytest.raises(LinkAbandoned):  # b never takes part: a silent peer
        weighted_mean([torch.ones(1000)], 1.0, groups[0], gone.is_set)
    waited = time.monotonic() - t0
    assert waited < 0.5 + 3 * POLL_S, waited
    t0 = time.monotonic()
    a.forget()  # gloo's destructor waits for the queued all-reduce: not on this thread
    assert time.monotonic() - t0 < 0.2


def test_a_peer_that_drops_its_group_fails_the_collective_with_its_own_error(store):
    """A closed peer is an error of the collective itself, at once, not an abort."""
    _a, b, groups = _pair(store, 2)
    threading.Timer(0.3, b.forget).start()
    del groups[1]
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        weighted_mean([torch.ones(1000)], 1.0, groups[0], lambda: False)
    assert not isinstance(err.value, LinkAbandoned), err.value
    assert time.monotonic() - t0 < 5, err.value


def test_the_weighted_mean_through_the_polled_wait(store):
    _a, _b, groups = _pair(store, 4)
    out: dict = {}

    def member(i: int) -> None:
        out[i] = weighted_mean([torch.full((5,), float(i + 1))], float(i + 1), groups[i],
                               lambda: False)

    threads = [threading.Thread(target=member, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    for i in (0, 1):  # (1 * 1 + 2 * 2) / 3
        avg, total = out[i]
        assert total == 3.0 and torch.allclose(avg[0], torch.full((5,), 5 / 3))


@pytest.mark.parametrize("mode", ["bf16", "int8"])
def test_the_weighted_mean_sent_compressed(store, mode):
    """DiLoCo's ``compress`` on the link between replica groups: the weighted mean within
    the code's rounding, the same on both members, and each member's own decoded part."""
    _a, _b, groups = _pair(store, 5 if mode == "bf16" else 6)
    torch.manual_seed(0)
    xs = [torch.randn(3000), torch.randn(3000)]
    out: dict = {}

    def member(i: int) -> None:
        out[i] = compressed_weighted_mean([xs[i][:1000], xs[i][1000:]], float(i + 1),
                                          groups[i], mode, lambda: False)

    threads = [threading.Thread(target=member, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    want = (xs[0] + 2 * xs[1]) / 3
    tol = 0.02 if mode == "bf16" else 0.05  # bf16: 8 bits of mantissa; int8: 1/127 of a chunk
    for i in (0, 1):
        avg, total, own = out[i]
        assert total == 3.0 and [a.shape for a in avg] == [(1000,), (2000,)]
        assert torch.allclose(torch.cat(avg), want, atol=tol), (torch.cat(avg) - want).abs().max()
        assert torch.allclose(torch.cat(own), xs[i], atol=tol)
    assert torch.equal(torch.cat(out[0][0]), torch.cat(out[1][0]))  # every member alike
