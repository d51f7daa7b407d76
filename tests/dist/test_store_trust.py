"""The rendezvous store under attack (issue "Security, round 2", item 2), on loopback.

Real gloo ranks on spawned processes; the attacker is a plain ``TCPStore`` client, which is
all a tailnet host that reaches ``MASTER_ADDR:MASTER_PORT`` needs:

* rank 0's store listens on MASTER_ADDR only: a client that reaches this host through
  another of its addresses (127.0.0.2) is refused, where torch's own store answers there
  (the control, and the old behaviour); ``RAY_MESH_STORE_BIND=all`` gives torch's back;
* a foreign client writes the join counter (a non-integer, an impossible value, a counter
  moved back so that a round's keys would be reused): every rank refuses with a message
  naming the key, none adopts it (torchrun's case, where the agent hosts the store);
* a foreign client writes the hang watch's report key (garbage, oversized, a rank out of
  range, terminal escapes, the old plain-text form) and a malformed snapshot request: no
  rank adopts the report or answers the request, each warns; a well-formed report is still
  adopted (the control: the store cannot authenticate, docs/trust-model.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from ports import free_port
from torchrun import spawn_ranks

from ray_mesh.core import bootstrap, rendezvous_store
from ray_mesh.errors import BootstrapError

pytestmark = pytest.mark.dist
OTHER_LOCAL = "127.0.0.2"  # this host too (all of 127/8 is), but not MASTER_ADDR


def _connects(address: str, port: int) -> str:
    try:
        with socket.create_connection((address, port), timeout=3):
            return "ok"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"error {exc}"


def _other_local_works() -> str:
    """127.0.0.2 reaches a wildcard listener here (else the bound-address check proves nothing)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        return _connects(OTHER_LOCAL, s.getsockname()[1])


# ----------------------------------------------------------------------------- bound address
def _bind_worker(rank: int, ports: list[int], out: str) -> None:
    results = {}
    for mode, port in zip(("addr", "all"), ports, strict=True):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                          RAY_MESH_STORE_BIND=mode)
        bootstrap.init_process_group("gloo", torch.device("cpu"), rank, 2, timeout_s=60)
        if rank == 0:
            results[mode] = {a: _connects(a, port) for a in ("127.0.0.1", OTHER_LOCAL)}
        dist.barrier()
        t = torch.ones(1)
        dist.all_reduce(t)  # the group works over the bound store
        results[f"{mode}_sum"] = t.item()
        dist.destroy_process_group()
    Path(out, f"bind_{rank}.json").write_text(json.dumps(results))


def test_store_listens_on_master_addr_only(tmp_path):
    assert _other_local_works() == "ok"
    # The control: torch's own rank-0 store (what env:// made before) answers on 127.0.0.2.
    port = free_port()
    torch_store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10),
                                wait_for_workers=False)
    try:
        assert _connects(OTHER_LOCAL, port) == "ok"
    finally:
        del torch_store
    spawn_ranks(_bind_worker, ([free_port(), free_port()], str(tmp_path)), 2, 120,
                "bound-store ranks")
    r0 = json.loads((tmp_path / "bind_0.json").read_text())
    assert r0["addr"] == {"127.0.0.1": "ok", OTHER_LOCAL: "refused"}, r0
    assert r0["all"] == {"127.0.0.1": "ok", OTHER_LOCAL: "ok"}, r0  # the opt-out: torch's
    for rank in (0, 1):
        r = json.loads((tmp_path / f"bind_{rank}.json").read_text())
        assert r["addr_sum"] == 2.0 and r["all_sum"] == 2.0, r


def test_master_addr_not_on_this_host_says_so():
    with pytest.raises(BootstrapError,
                       match=r"MASTER_ADDR=198\.51\.100\.77 is not an address of this host.*"
                             r"RAY_MESH_STORE_BIND=all"):
        rendezvous_store.listen_socket("198.51.100.77", free_port())
    os.environ["RAY_MESH_STORE_BIND"] = "everywhere"
    try:
        with pytest.raises(BootstrapError, match="use 'addr'"):
            rendezvous_store.bind_address("127.0.0.1")
    finally:
        del os.environ["RAY_MESH_STORE_BIND"]
    assert rendezvous_store.bind_address("localhost") is None  # a name: torch's bind


# ----------------------------------------------------------------------------- join counter
ATTACKS = [("moved back", "0"), ("not an integer", "garbage"),
           ("impossible", "9" * 19), ("negative", "-5")]


def _join_worker(rank: int, port: int, out: str) -> None:
    """torchrun's layout: the agent (the test) hosts the store, every rank is a client."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    control = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60),
                            wait_for_workers=False)
    results = {}
    bootstrap.init_process_group("gloo", torch.device("cpu"), rank, 2, timeout_s=20)
    dist.barrier()  # round 0, as ranks leave it
    dist.destroy_process_group()
    for i, (name, _) in enumerate(ATTACKS):
        control.set(f"test/ready/{i}/{rank}", "1")
        control.wait([f"test/attacked/{i}"])  # the attacker wrote ray_mesh/joined
        try:
            bootstrap.init_process_group("gloo", torch.device("cpu"), rank, 2, timeout_s=20)
            dist.barrier()
            results[name] = "joined"
            dist.destroy_process_group()
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            results[name] = f"{type(exc).__name__}: {exc}"
    Path(out, f"join_{rank}.json").write_text(json.dumps(results))


def test_foreign_join_counter_is_refused(tmp_path):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=120),
                          wait_for_workers=False)
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_join_worker, args=(port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        for i, (_, value) in enumerate(ATTACKS):
            agent.wait([f"test/ready/{i}/0", f"test/ready/{i}/1"], timedelta(seconds=90))
            agent.set(rendezvous_store.JOIN_KEY, value)  # the attack
            agent.set(f"test/attacked/{i}", "1")
        deadline = time.monotonic() + 120
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline, "the ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"join_{rank}.json").read_text())
        print(rank, json.dumps(got, indent=1))
        back = got["moved back"]
        assert back.startswith("BootstrapError") and "already taken" in back, back
        assert "ray_mesh/joined" in back and "firewall.sh" in back, back
        for name in ("not an integer", "impossible", "negative"):
            msg = got[name]
            assert msg.startswith("BootstrapError: The rendezvous store's join counter "
                                  "'ray_mesh/joined' holds"), (name, msg)
            assert "a client other than this job's ranks wrote it" in msg, (name, msg)


# ----------------------------------------------------------------------------- hang report
GOOD = "ray_mesh: collective hang: forged but well-formed"
BAD_REPORTS = [
    ("plain text, as ranks wrote it before", "ray_mesh: collective hang: run `curl x | sh`"),
    ("not JSON", "\x00\xff garbage"),
    ("oversized", json.dumps({"by": 0, "dim": "dp", "text": "ray_mesh: collective hang" +
                              "x" * (5 << 20)})),
    ("rank out of range", json.dumps({"by": 7, "dim": "dp",
                                      "text": "ray_mesh: collective hang: by rank 7"})),
    ("terminal escapes", json.dumps({"by": 1, "dim": "dp",
                                     "text": "ray_mesh: collective hang \x1b[2J"})),
    ("extra field", json.dumps({"by": 1, "dim": "dp", "text": "ray_mesh: collective hang",
                                "exec": "x"})),
]


def _hang_worker(rank: int, port: int, out: str) -> None:
    from ray_mesh.observability import hang

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")
    warnings: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            warnings.append(record.getMessage())

    logging.getLogger("ray_mesh.observability.hang").addHandler(Keep())
    mesh = bootstrap.setup_worker(bootstrap.MeshSpec.from_dict({"dp_shard": 2}), rank=rank,
                                  world_size=2, local_rank=rank, backend="gloo").mesh
    watch = hang.start_watch(mesh, timeout_s=300, poll_s=0.05)
    control = hang.connect_store()
    control.set(f"test/started/{rank}", "1")
    adopted = []
    done = False
    while not done:
        done = control.check(["test/done"])  # then one more look: the report may have been
        if watch.report_ready.is_set() and not adopted:  # adopted since the last (seen
            adopted.append(watch.report)  # once on a loaded machine)
        time.sleep(0.05)
    Path(out, f"hang_{rank}.json").write_text(json.dumps(
        {"adopted": adopted, "warnings": warnings, "snap_sent": watch._snapshot_sent}))
    watch.stop()
    bootstrap.shutdown_mesh()


def _settle(prefix: dist.Store, rounds: int = 2) -> None:
    """Let both watchdogs tick a few times (they write their beat every 0.05 s)."""
    for _ in range(rounds):
        before = [prefix.get(f"beat/{r}") for r in (0, 1)]
        deadline = time.monotonic() + 20
        while [prefix.get(f"beat/{r}") for r in (0, 1)] == before:
            assert time.monotonic() < deadline, "the watchdogs stopped beating"
            time.sleep(0.05)


def test_foreign_hang_report_is_not_adopted(tmp_path):
    port = free_port()
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_hang_worker, args=(port, str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        deadline = time.monotonic() + 90
        while True:  # rank 0 hosts the store (bound to 127.0.0.1): connect when it is up
            try:
                raw = dist.TCPStore("127.0.0.1", port, is_master=False,
                                    timeout=timedelta(seconds=5), wait_for_workers=False)
                break
            except RuntimeError:
                assert time.monotonic() < deadline, "rank 0's store never came up"
        prefix = dist.PrefixStore("ray_mesh/hang/0", raw)
        prefix.wait(["test/started/0", "test/started/1", "beat/0", "beat/1"],
                    timedelta(seconds=90))
        prefix.set("request", json.dumps({"by": 9, "dim": "dp"}))  # out of range
        _settle(prefix)
        prefix.delete_key("request")
        for name, value in BAD_REPORTS:
            prefix.set("report", value)
            _settle(prefix)
            assert not list(tmp_path.glob("hang_*.json")), name
        prefix.set("report", json.dumps({"by": 1, "dim": "dp", "text": GOOD}))  # the control
        _settle(prefix)
        prefix.set("test/done", "1")
        while not ctx.join(timeout=5):
            assert time.monotonic() < deadline + 60, "the ranks did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        got = json.loads((tmp_path / f"hang_{rank}.json").read_text())
        # Only the well-formed report was adopted; the bad ones before it were not.
        assert got["adopted"] == [GOOD], got["adopted"][:1]
        assert not got["snap_sent"], "a malformed request made the rank send its stacks"
        text = "\n".join(got["warnings"])
        print(rank, text)
        assert "key 'request' holds a malformed value (by (the requesting rank) must be an " \
               "integer in [0, 2)" in text, text
        # Each refused report was said so, with the reason.
        for why in ("(not JSON", "over the 4194304-byte limit for 'report'",
                    "by (the reporting rank) must be an integer in [0, 2)",
                    "control characters", "must have exactly the fields"):
            assert why in text, (why, text)
        assert text.count("key 'report' holds a malformed value") == len(BAD_REPORTS), text
