"""The replica groups' cross-group store under attack (issue "Security, round 3", item 1).

Real parts on loopback: the store as the coordinator serves it
(:func:`ray_mesh.replicas.link_store.serve_store`), real ``CrossLink`` members building
real gloo groups on it, and an attacker that is a plain ``TCPStore`` client (all a host
that reaches the port needs):

* the store listens on the node's address only: bound to 127.0.0.2, it refuses 127.0.0.1
  (torch's ``TCPStore(host, 0, is_master=True)``, what the coordinator built before, answers
  there: the control);
* an attacker that joins an epoch's rendezvous as a member (its own gloo group, its own
  address written under the member's key) is refused by the real member before any tensor
  moves, where it used to receive the heal broadcast;
* oversized, short, unsigned, foreign-key and replayed values under a member's key are each
  refused with a ``BootstrapError`` that names the key and the problem, before gloo parses
  them (gloo itself answered ``std::bad_alloc`` to such bytes).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from ray_mesh.errors import BootstrapError
from ray_mesh.replicas.link import POLL_S, CrossLink, send_state_
from ray_mesh.replicas.link_store import MAX_VALUE_BYTES, serve_store

pytestmark = pytest.mark.dist
OTHER_LOCAL = "127.0.0.2"  # this host too (all of 127/8 is), but not the store's address
TIMEOUT_S = 20.0


def _connects(address: str, port: int) -> str:
    try:
        with socket.create_connection((address, port), timeout=3):
            return "ok"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"error {exc}"


def test_the_store_listens_on_the_node_address_only():
    with socket.socket() as s:  # 127.0.0.1 reaches a wildcard listener (else this proves nothing)
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        assert _connects("127.0.0.1", s.getsockname()[1]) == "ok"
    # The control: the coordinator's old store, torch's own bind, answers on every address.
    old = dist.TCPStore(OTHER_LOCAL, 0, is_master=True, wait_for_workers=False)
    assert _connects("127.0.0.1", int(old.port)) == "ok"
    del old
    store, (host, port, key) = serve_store(OTHER_LOCAL)
    assert (host, len(key)) == (OTHER_LOCAL, 64)
    assert _connects(OTHER_LOCAL, port) == "ok"
    assert _connects("127.0.0.1", port) == "refused"
    client = dist.TCPStore(OTHER_LOCAL, port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert client.get("k") == b"v"
    assert serve_store(OTHER_LOCAL)[1][2] != key  # a fresh key per store


def test_bad_store_addresses_and_keys_say_what_to_do():
    with pytest.raises(BootstrapError, match="IP address of this node"):
        serve_store("head.example")
    with pytest.raises(BootstrapError, match="not an address of this node.*"
                                             "RAY_MESH_STORE_BIND=all"):
        serve_store("192.0.2.1")  # TEST-NET-1: never a local address


def test_the_all_interfaces_bind_is_asked_for_by_name(monkeypatch):
    """Behind NAT (the node's address is not on the box), as the rendezvous store."""
    monkeypatch.setenv("RAY_MESH_STORE_BIND", "all")
    store, (host, port, _key) = serve_store(OTHER_LOCAL)
    assert _connects("127.0.0.1", port) == "ok"
    monkeypatch.setenv("RAY_MESH_STORE_BIND", "everywhere")
    with pytest.raises(BootstrapError, match="RAY_MESH_STORE_BIND='everywhere'"):
        serve_store(OTHER_LOCAL)
    with pytest.raises(BootstrapError, match="64 hex digits.*Coordinator.store_address"):
        CrossLink("127.0.0.1", 1, 0, key="not-hex")


def _raw(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


class _Stripping(dist.Store):
    """An attacker who knows the format: it drops the members' signature before gloo reads."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner = inner

    def set(self, key, value):
        self.inner.set(key, value)

    def get(self, key):
        return bytes(self.inner.get(key))[32:]

    def wait(self, keys, timeout=None):
        self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)


def test_a_stranger_cannot_join_an_epoch_and_receive_the_heal_broadcast():
    store, (host, port, key) = serve_store("127.0.0.1")
    attacker: dict = {}

    def join_as_member_1() -> None:  # what any host reaching the port can run
        prefix = _Stripping(dist.PrefixStore("replicas/3/0/", _raw(port)))
        try:
            pg = dist.ProcessGroupGloo(prefix, 1, 2, timedelta(seconds=5))
            got = torch.zeros(4)
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            pg.broadcast([got], opts).wait()
            attacker["got"] = got
        except Exception as exc:  # noqa: BLE001 - the attacker's outcome is not the point
            attacker["error"] = exc

    t = threading.Thread(target=join_as_member_1, daemon=True)
    t.start()
    member = CrossLink(host, port, 0, TIMEOUT_S, key=key)
    weights = [torch.arange(4.0)]
    with pytest.raises(BootstrapError, match=r"'replicas/3/0/0/1' is not signed with this "
                                             r"run's key.*firewall"):
        send_state_(weights, 0, [1], member.group(3, 0, 2), 0)
    t.join(3)  # its gloo gives up on its own later (connect retries, ~25 s)
    assert "got" not in attacker, attacker  # nothing of the member's state reached it


def _built(group: object) -> bool:
    return group is not None and not isinstance(group, BaseException)


def _on_threads(n: int, fn) -> list:  # noqa: ANN001 - fn(i) for member i
    """``fn(i)`` for ``i < n``, each on a thread of its own, all at once: what each returned,
    or the exception it raised (bounded: a thread not done in TIMEOUT_S leaves None)."""
    out: list = [None] * n

    def run(i: int) -> None:
        try:
            out[i] = fn(i)
        except Exception as exc:  # noqa: BLE001 - checked by the caller
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT_S)
    return out


def _build(links: list[CrossLink], epoch: int) -> list:
    return _on_threads(len(links), lambda i: links[i].group(epoch, i, len(links)))


def test_a_link_between_members_still_works():
    store, (host, port, key) = serve_store("127.0.0.1")
    links = [CrossLink(host, port, 0, TIMEOUT_S, key=key) for _ in range(2)]
    groups = _build(links, 1)
    assert all(_built(g) for g in groups), groups
    tensors = [[torch.arange(4.0)], [torch.zeros(4)]]
    done = [threading.Thread(target=send_state_, args=(tensors[i], 0, [1], groups[i], i))
            for i in (0, 1)]
    for th in done:
        th.start()
    for th in done:
        th.join(TIMEOUT_S)
    assert torch.equal(tensors[1][0], torch.arange(4.0))
    for link in links:
        link.forget()


def _foreign_key_value() -> bytes:
    """A member's value, signed with another run's key (a well-formed gloo address)."""
    store, (host, port, _key) = serve_store("127.0.0.1")
    other_key = serve_store("127.0.0.1")[1][2]
    links = [CrossLink(host, port, 0, TIMEOUT_S, key=other_key) for _ in range(2)]
    groups = _build(links, 2)
    assert all(_built(g) for g in groups), groups
    value = bytes(_raw(port).get("replicas/2/0//0/1"))
    for link in links:
        link.forget()
    return value


@pytest.mark.parametrize("kind", ["oversized", "short", "unsigned", "foreign key", "replayed"])
def test_values_a_member_did_not_write_are_refused_before_gloo_reads_them(kind):
    store, (host, port, key) = serve_store("127.0.0.1")
    raw = _raw(port)
    if kind == "replayed":  # a member's real value of epoch 6, copied to epoch 7
        links = [CrossLink(host, port, 0, TIMEOUT_S, key=key) for _ in range(2)]
        assert all(_built(g) for g in _build(links, 6))
        value = bytes(raw.get("replicas/6/0//0/1"))
        for link in links:
            link.forget()
    else:
        value = {"oversized": b"\x02" * (MAX_VALUE_BYTES + 1), "short": b"xx",
                 "unsigned": bytes(range(256)) * 2, "foreign key": None}[kind]
        value = _foreign_key_value() if value is None else value
    raw.set("replicas/7/0//0/1", value)  # member 1's gloo address, in epoch 7
    why = {"oversized": f"holds {len(value)} bytes, more than the {MAX_VALUE_BYTES}",
           "short": "holds 2 bytes, too short for the 32-byte signature"}.get(
        kind, "is not signed with this run's key")
    link = CrossLink(host, port, 0, TIMEOUT_S, key=key)
    with pytest.raises(BootstrapError) as err:
        link.group(7, 0, 2)
    text = str(err.value)
    assert f"store (127.0.0.1:{port}) key 'replicas/7/0/0/1' {why}" in text, text
    assert "a client other than this run's groups wrote it" in text
    assert "deploy/tailscale/firewall.sh" in text


def _send_on_threads(tensors: list, groups: list, src, healers: list[int],
                     shared: list[bool] | None = None, late: dict[int, float] | None = None
                     ) -> dict[int, object]:
    """``send_state_`` on every member at once (``late[i]`` seconds later for member i):
    what each returned, or raised."""
    def send(i: int) -> object:
        time.sleep((late or {}).get(i, 0.0))
        return send_state_(tensors[i], src, healers, groups[i], i, abort=lambda: False,
                           shared=shared)

    return dict(enumerate(_on_threads(len(tensors), send)))


def test_a_heal_reaches_the_healer_alone_across_polled_waits():
    """send_state_ goes to the healers only (a third member gets nothing and waits for
    nothing), and a receive that waits longer than the link's abort poll still completes:
    a gloo receive whose wait times out is abandoned for good, so the waits are not polled
    with timeouts (the lab job's heal once retried forever that way)."""
    store, (host, port, key) = serve_store("127.0.0.1")
    links = [CrossLink(host, port, 0, TIMEOUT_S, key=key) for _ in range(3)]
    groups = _build(links, 1)
    assert all(_built(g) for g in groups), groups
    tensors = [[torch.arange(6.0), torch.tensor([7])], [torch.zeros(6), torch.tensor([1])],
               [torch.zeros(6), torch.tensor([2])]]
    # the healer is already waiting when the donor sends, past several polls
    got = _send_on_threads(tensors, groups, 0, [2], late={0: 3 * POLL_S})
    assert got == {0: 0, 1: 0, 2: 6 * 4 + 8}, got
    assert torch.equal(tensors[2][0], torch.arange(6.0)) and int(tensors[2][1]) == 7
    assert torch.equal(tensors[1][0], torch.zeros(6)) and int(tensors[1][1]) == 1
    for link in links:
        link.forget()


def test_a_heal_from_two_donors_takes_each_shared_part_once_and_the_rest_from_the_first():
    """Members 0 and 2 hold the newest step, 3 heals, 1 is a bystander. Each donor sends a
    part of the shared entries (``state_sources``); the unshared one (a donor's own, here
    different on the two) comes from the first donor whole. The healer ends with the first
    donor's state, every byte once; the bystander gets and waits for nothing."""
    store, (host, port, key) = serve_store("127.0.0.1")
    links = [CrossLink(host, port, 0, TIMEOUT_S, key=key) for _ in range(4)]
    groups = _build(links, 1)
    assert all(_built(g) for g in groups), groups

    def state(fill: float, own: float) -> list[torch.Tensor]:
        return [torch.full((300,), fill), torch.full((200,), fill + 1),
                torch.arange(100, dtype=torch.float64) + fill, torch.full((4,), own),
                torch.tensor([5], dtype=torch.int64)]

    shared = [True, True, True, False, True]
    tensors = [state(1.0, 10.0), state(0.0, 0.0), state(1.0, 20.0), state(0.0, 0.0)]
    got = _send_on_threads(tensors, groups, [0, 2], [3], shared=shared)
    total = sum(t.numel() * t.element_size() for t in tensors[0])
    assert got == {0: 0, 1: 0, 2: 0, 3: total}, got
    for mine, first in zip(tensors[3], tensors[0], strict=True):
        assert torch.equal(mine, first), (mine, first)
    assert float(tensors[1][0][0]) == 0.0  # the bystander's own, untouched
