"""Replica groups of different layouts, without Ray: each group a torchrun world of its own
(``tests/helpers/_replica_layouts.py``), the run's ``Quorum`` served by this process.

* An FSDP2 group of 2 ranks and an unsharded group of 1 train together (``exchange="full"``):
  every step's update is the mean gradient over both groups' samples, so both end with the
  parameters of one model trained on the union of the samples, step by step.
* A ``tp=2`` group joins a run an unsharded group has been training alone: it heals from it
  (the full state, resharded into its own layout), and both end with the same parameters.
* DiLoCo groups (FSDP2 of 2, unsharded) end with the same model.
* The run's fallback checkpoint in an S3 bucket (a real moto server): an FSDP2 group of 2
  writes it every 3 steps and the whole group leaves at step 6; a ``tp=2`` group joining
  then restores step 6 from the bucket (another layout, through DCP) with its optimizer
  state, and ends where one model trained on the same samples does.

A group that joins late is started with the others and let into the run (registered with
the quorum) only when its turn comes (``JOIN_AFTER``): the quorum sees the same late
arrival, and the test does not wait out a torchrun start in the middle.

The runs of an FSDP2 group beside an unsharded or a ``tp=2`` one (the full exchange with
each compression, DiLoCo) share one torchrun start per pair of layouts (``_pair_runs``):
each run has its own quorum, a fresh model and optimizer, and is checked by its own test.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.managers import BaseManager
from pathlib import Path

import pytest
import torch
from local_quorum import LocalCoordinator
from ports import free_port

from ray_mesh.replicas.quorum import Quorum

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "helpers" / "_replica_layouts.py"
AUTHKEY = b"replica-layouts"


class _Served:
    """A Quorum and a TCP store for the groups, served until closed."""

    def __init__(self, steps: int, expected_groups: int, dead_after_s: float = 10.0) -> None:
        from ray_mesh.replicas.link_store import serve_store

        self.store, address = serve_store("127.0.0.1")  # as the Ray coordinator serves it
        self.quorum = Quorum(segment_samples=8, total_steps=steps, dead_after_s=dead_after_s,
                             arrive_timeout_s=60.0, expected_groups=expected_groups,
                             start_timeout_s=60.0)
        self.coordinator = LocalCoordinator(self.quorum, address)

        class Manager(BaseManager):
            pass

        Manager.register("coordinator", callable=lambda: self.coordinator)
        self.server = Manager(address=("127.0.0.1", 0), authkey=AUTHKEY).get_server()
        self.port = self.server.address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def _launch(gid: int, layout: str, nproc: int, port: int, steps: int, out: Path,
            step_s: float = 0.0, wait_groups: int = 0,
            die_at: int = -1, pg_timeout_s: float = 600.0,
            extra_env: dict[str, str] | None = None,
            runs: list[dict] | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    env.update(extra_env or {})
    if runs:  # several runs one after the other (the helper's RUNS)
        env["RUNS"] = json.dumps(runs)
    env["PG_TIMEOUT_S"] = str(pg_timeout_s)
    env["STEP_S"], env["WAIT_GROUPS"] = str(step_s), str(wait_groups)
    env["DIE_AT_STEP"] = str(die_at)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SCRIPT),
         str(gid), layout, str(port), str(steps), str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a group did not finish within {timeout_s} s")
        outs.append(out)
        assert p.returncode == 0, out[-6000:]
    return outs


@contextmanager
def _killed_on_failure(procs: list[subprocess.Popen]) -> Iterator[None]:
    """Groups started ahead of their turn: killed if the test fails before it lets them in."""
    try:
        yield
    except BaseException:
        for p in procs:
            p.kill()
        raise


def _rows(out: Path, gid: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"g{gid}.jsonl").read_text().splitlines()]


def _reference(steps_ranges: list[list[list[int]]]) -> list[torch.Tensor]:
    """One unsharded model trained on each step's samples (every group's, as one batch)."""
    from harness.replica_train import make_model, samples

    model = make_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for ranges in steps_ranges:
        ids = [i for start, n in ranges for i in range(start, start + n)]
        x, y = samples(ids)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    return [p.detach() for p in model.parameters()]


# The runs of each pair of layouts (an FSDP2 group of 2 beside ``other``): (kind, compress,
# steps). One torchrun start per group serves them all, one after the other.
PAIR_RUNS = {"plain": [("full", "none", 6), ("diloco", "none", 5)],
             "tp": [("full", "none", 6), ("full", "int8", 6), ("diloco", "none", 5)]}


@pytest.fixture(scope="module")
def pair_runs(tmp_path_factory):
    """``pair_runs(other)``: {(kind, compress): (served quorum, out dir)} of the pair's runs,
    done once for the module (at the first test that asks), its failure kept for the rest."""
    done: dict[str, dict | BaseException] = {}

    def get(other: str) -> dict:
        if other not in done:
            try:
                done[other] = _run_pair(other, tmp_path_factory)
            except BaseException as exc:
                done[other] = exc
        got = done[other]
        if isinstance(got, BaseException):
            raise got
        return got
    return get


def _run_pair(other: str, tmp_path_factory) -> dict:
    runs, result = [], {}
    for kind, compress, steps in PAIR_RUNS[other]:
        served = _Served(steps, expected_groups=2)
        out = tmp_path_factory.mktemp(f"{other}-{kind}-{compress}")
        env = {"COMPRESS": compress, "DILOCO_EVERY": "2" if kind == "diloco" else "0"}
        runs.append({"port": served.port, "steps": steps, "out": str(out), "env": env})
        result[kind, compress] = served, out
    first = runs[0]
    _finish([_launch(0, "fsdp", 2, first["port"], first["steps"], Path(first["out"]),
                     runs=runs),
             _launch(1, other, 1 if other == "plain" else 2, first["port"], first["steps"],
                     Path(first["out"]), runs=runs)], 200)
    return result


@pytest.mark.timeout(240)
@pytest.mark.parametrize("compress, other", [("none", "plain"), ("none", "tp"), ("int8", "tp")])
def test_fsdp_and_unsharded_groups_train_as_one_model(pair_runs, compress, other):
    """Uncompressed, each step's update is the mean gradient over both groups' samples:
    both groups end with the parameters of one model trained on the union of the samples.
    With ``compress="int8"`` the gradients cross as int8 with error feedback: both groups
    still end equal (each decodes the same bytes), close to that model but not bitwise.

    Beside an unsharded group of 1 the leaders carry the whole exchange; beside a ``tp=2``
    group (2 ranks each) it is spread over both ranks of each group, each carrying its own
    slice on its own link (``Decision.lanes``, :mod:`ray_mesh.replicas.reshard`)."""
    steps = 6
    served, tmp_path = pair_runs(other)["full", compress]
    lanes = {(int(g), int(r)): int(f.read_text())
             for f in tmp_path.glob("lanes_g*_r*")
             for g, r in re.findall(r"lanes_g(\d)_r(\d)$", f.name)}
    if other == "plain":  # the leaders' path: no lane carried a slice
        assert set(lanes.values()) == {0}, lanes
    else:  # every rank of both groups carried a slice of every step, about half each
        assert set(lanes) == {(0, 0), (0, 1), (1, 0), (1, 1)}, lanes
        assert all(b > 0 for b in lanes.values()), lanes
        assert lanes[(0, 0)] == lanes[(1, 0)] and lanes[(0, 1)] == lanes[(1, 1)], lanes
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    rows = {g: _rows(tmp_path, g) for g in (0, 1)}
    assert [r["step"] for r in rows[0]] == list(range(1, steps + 1)), rows
    per_step = [[*r0["ranges"], *r1["ranges"]] for r0, r1 in zip(rows[0], rows[1], strict=True)]
    ref = _reference(per_step)
    worst = 0.0
    for x, y, r in zip(a, b, ref, strict=True):
        assert torch.allclose(x, y, atol=1e-6), (x - y).abs().max()
        if compress == "none":
            assert torch.allclose(x, r, atol=1e-5), (x - r).abs().max()
        worst = max(worst, float((x.detach() - r).abs().max() / r.abs().max()))
    if compress != "none":  # int8 of each 1,024 values: ~0.4% of the largest, fed back
        assert 1e-5 < worst < 0.01, worst
    print(f"compress {compress}: largest difference from one model {worst:.2e}")
    assert served.coordinator.layouts == {0: "fsdp=2", 1: "plain=1" if other == "plain"
                                          else "tp=2"}


@pytest.mark.timeout(240)
def test_a_tp_group_heals_from_an_unsharded_one_and_both_end_equal(tmp_path):
    steps = 80  # 0.5 s a step until the joiner is in: 40 s for it to join once let in
    served = _Served(steps, expected_groups=1)
    first = _launch(1, "plain", 1, served.port, steps, tmp_path, step_s=0.5, wait_groups=2)
    # started now, joins the run once group 1 has trained 3 steps alone
    gate = tmp_path / "join"
    joiner = _launch(0, "tp", 2, served.port, steps, tmp_path,
                     extra_env={"JOIN_AFTER": str(gate)})
    with _killed_on_failure([first, joiner]):
        deadline = time.monotonic() + 90
        log = tmp_path / "g1.jsonl"
        while not (log.exists() and len(log.read_text().splitlines()) >= 3):
            assert time.monotonic() < deadline and first.poll() is None, \
                "group 1 did not start"
            assert joiner.poll() is None, joiner.communicate()[0][-3000:]
            time.sleep(0.2)
        gate.touch()
    outs = _finish([first, joiner], 200)
    assert "healed_bytes 0" not in outs[1] and f"step {steps}" in outs[1], outs[1][-3000:]
    kinds = [(e["kind"], e["group"]) for e in served.quorum.status()["events"]]
    assert ("healed", 0) in kinds, kinds
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-6), (x - y).abs().max()
    assert _rows(tmp_path, 0)[-1]["step"] == steps


@pytest.mark.timeout(240)
@pytest.mark.parametrize("other", ["plain", "tp"])
def test_diloco_groups_of_different_layouts_end_with_the_same_model(pair_runs, other):
    """DiLoCo across an FSDP2 group of 2 and an unsharded one (the leaders carry the
    exchange) or a ``tp=2`` one (spread over both ranks of each): the pseudo-gradients and
    the outer state (global parameters, momentum) cross as full tensors; both groups end
    equal. (5 steps, a round every 2: ``PAIR_RUNS``.)"""
    _, tmp_path = pair_runs(other)["diloco", "none"]
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-6), (x - y).abs().max()
    losses = [float((tmp_path / f"g{g}.eval").read_text()) for g in (0, 1)]
    assert abs(losses[0] - losses[1]) < 1e-6 and losses[0] < 0.6, losses  # 0.65 untrained


@pytest.mark.timeout(240)
def test_a_group_failing_after_the_quorum_named_it_does_not_stall_the_others(tmp_path):
    """A worker of an FSDP group dies as the group joins: the first quorum names all three
    groups, the others wait for its leader in the rendezvous of the epoch's cross-group link,
    and that leader never comes (its own world broke first). Their heartbeats tell them the
    epoch lost a member, and they go on at once without it, instead of waiting for the
    link's whole timeout (20 s here)."""
    steps = 8
    served = _Served(steps, expected_groups=3)
    survivors = [_launch(0, "fsdp", 2, served.port, steps, tmp_path),
                 _launch(1, "plain", 1, served.port, steps, tmp_path)]
    dying = _launch(2, "fsdp", 2, served.port, steps, tmp_path, die_at=0)
    _finish(survivors, 200)
    out, _ = dying.communicate(timeout=60)
    assert dying.returncode != 0 and "FAILED group 2 rank 0 at step 0" in out, out[-4000:]
    events = served.quorum.status()["events"]
    left = [e for e in events if e["kind"] == "left" and e["group"] == 2]
    assert left and "failed" in left[0]["detail"], events
    assert ("joined", 2) in [(e["kind"], e["group"]) for e in events], events  # named first
    for gid in (0, 1):
        rows = _rows(tmp_path, gid)
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
        # the first step: the rendezvous abandoned, the link rebuilt, one step computed
        assert rows[0]["t"] - left[0]["t"] < 6, (gid, rows[0]["t"] - left[0]["t"])
        assert {r["groups"] for r in rows} == {2}, rows
    a, b = (torch.load(tmp_path / f"g{g}.pt") for g in (0, 1))
    for x, y in zip(a, b, strict=True):
        assert torch.allclose(x, y, atol=1e-6), (x - y).abs().max()


@pytest.mark.timeout(240)
def test_a_group_waiting_longer_than_its_collective_bound_for_a_late_one_stays_in(tmp_path):
    """On a busy machine one group can start a minute after the others. Its peers' leaders
    wait for it at the first quorum while their other ranks wait in a collective: one long
    wait ended at the group's collective bound (MeshConfig's hang watch makes it 75 s) and
    failed the group (seen: four such failures at step 0, then GroupsFailed). The leader
    now meets the quorum in short calls and shares each answer, so a wait of any length is
    many short collectives: here 1.6x the bound (an FSDP group whose process groups time
    out after 7 s; the other group joins 11 s after it arrived, started meanwhile)."""
    bound_s, late_s = 7.0, 11.0
    served = _Served(3, expected_groups=2)
    arrived: list[float] = []  # when group 0 first met the quorum
    arrive = served.coordinator.arrive

    def noting_arrive(gid, *args, **kwargs):
        if gid == 0 and not arrived:
            arrived.append(time.time())
        return arrive(gid, *args, **kwargs)

    served.coordinator.arrive = noting_arrive
    gate = tmp_path / "join"
    early = _launch(0, "fsdp", 2, served.port, 3, tmp_path, pg_timeout_s=bound_s)
    with _killed_on_failure([early]):
        deadline = time.monotonic() + 90
        while not arrived:
            assert time.monotonic() < deadline and early.poll() is None, "group 0 did not start"
            time.sleep(0.1)
    # started while group 0 waits, let in late_s after its arrival
    late = _launch(1, "plain", 1, served.port, 3, tmp_path, extra_env={"JOIN_AFTER": str(gate)})
    with _killed_on_failure([early, late]):
        time.sleep(max(0.0, arrived[0] + late_s - time.time()))
        gate.touch()
    _finish([early, late], 120)
    rows = _rows(tmp_path, 0)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["step"] for r in _rows(tmp_path, 1)] == [1, 2, 3]
    # group 0 waited at the first quorum longer than its collective bound, and stayed in
    assert rows[0]["t"] - arrived[0] > 1.5 * bound_s, rows[0]["t"] - arrived[0]


@pytest.mark.timeout(300)
def test_a_group_of_another_layout_restores_the_fallback_from_a_bucket(tmp_path):
    """No shared filesystem: the fallback checkpoint goes to an S3 bucket (a real moto
    server, ``ray-mesh storage serve``). An FSDP2 group of 2 checkpoints every 3 steps and
    leaves at step 6 (its upload done): every group is gone. A ``tp=2`` group (started
    ahead) then joins the run: the quorum has it restore step 6 from the bucket (DCP shards
    by global shape, checked against their manifest, loaded into the tp layout), parameters
    and momentum equal to what the FSDP group held, and it trains on from there as one
    model would."""
    import pyarrow.fs
    from moto_s3 import S3Server

    s3 = S3Server(bucket="fallback-dist")
    try:
        steps = 8
        # the group that leaves does not say so: the quorum drops it when its beats (every
        # 0.5 s) have stopped for dead_after_s, and only then takes the joiner in
        served = _Served(steps, expected_groups=1, dead_after_s=4.0)
        ckpt = {**s3.credentials, "CKPT_DIR": s3.uri("runs/rg-fallback"), "CKPT_EVERY": "3",
                "CKPT_ENDPOINT": s3.endpoint}
        first = _launch(0, "fsdp", 2, served.port, steps, tmp_path, step_s=0.3, wait_groups=2,
                        extra_env={**ckpt, "LEAVE_AT_STEP": "6"})
        # started now, joins the run once group 0 is gone
        gate = tmp_path / "join"
        second = _launch(1, "tp", 2, served.port, steps, tmp_path,
                         extra_env={**ckpt, "JOIN_AFTER": str(gate)})
        with _killed_on_failure([second]):
            out = _finish([first], 150)[0]
            assert "LEFT group 0 at step 6: {'step': 6" in out, out[-3000:]
            status = served.quorum.status()
            assert status["checkpoint"][0] == 6, status
            uri = status["checkpoint"][1]
            assert uri.startswith(s3.uri("runs/rg-fallback/checkpoint_00000006_")), uri
            names = {i.base_name for i in s3.filesystem().get_file_info(
                pyarrow.fs.FileSelector(uri[len("s3://"):], recursive=True))}
            assert {".metadata", "__0_0.distcp", "__1_0.distcp", "ray_mesh_manifest.json",
                    "ray_mesh_checkpoint.json"} <= names, names
            gate.touch()
        out = _finish([second], 200)[0]
        events = served.quorum.status()["events"]
        restore = [e for e in events if e["kind"] == "restore"]
        assert restore and restore[0]["step"] == 6 and uri in restore[0]["detail"], events
        left, back = torch.load(tmp_path / "g0.leave.pt"), torch.load(tmp_path / "g1.first.pt")
        for key in ("params", "momenta"):
            assert len(left[key]) == len(back[key]) == 4, key
            for x, y in zip(left[key], back[key], strict=True):
                assert torch.equal(x, y), (key, (x - y).abs().max())
        # steps 1-6 of group 0, then 7-8 of group 1 from the restored state: one model
        rows = _rows(tmp_path, 0)[:6] + [r for r in _rows(tmp_path, 1) if r["step"] > 6]
        assert [r["step"] for r in rows] == list(range(1, steps + 1)), rows
        ref = _reference([r["ranges"] for r in rows])
        final = torch.load(tmp_path / "g1.pt")
        for x, r in zip(final, ref, strict=True):
            assert torch.allclose(x, r, atol=1e-5), (x - r).abs().max()
    finally:
        s3.stop()
