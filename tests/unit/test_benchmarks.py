"""Smoke test of the benchmark harness: the cheapest section in quick mode.

Checks that ``benchmarks/run.py`` runs end to end and writes every field the table and
RESULTS.md read; never the timings themselves (performance claims live in benchmarks/).
Group counts are not timings: a size-1 dim must not hold a real communicator.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_quick_meshbuild_writes_every_field(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--only", "meshbuild",
         "--out", str(out)],
        capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "d mesh build" in proc.stdout
    res = json.loads(out.read_text())
    assert res["quick"] is True
    for key in ("nproc", "mem_gib", "torch", "ray", "python", "loadavg_start", "loadavg_end"):
        assert key in res["machine"], key
    assert set(res) >= {"command", "config", "started", "finished", "table", "meshbuild",
                        "total_s", "section_s"}
    # each section's wall time, and the run's: the smoke run's budget is read from them
    assert 0 < res["section_s"]["meshbuild"] <= res["total_s"], res["total_s"]
    row = res["meshbuild"]["ranks_4"]
    assert set(row) == {"needed_dims_only", "ray_mesh", "all_dims_real"}
    for variant in row.values():
        for field in ("seconds", "seconds_all", "new_group_calls", "groups_held",
                      "real_groups_held", "fake_groups_held", "threads"):
            assert field in variant, field
        assert variant["seconds"] > 0
    # HSDP 2 x 2 on 4 ranks: pp, cp and tp have size 1 and dp_shard_cp is dp_shard (cp=1).
    # ray_mesh keeps the three as fake groups and dp_shard_cp on a fake placeholder sharing
    # dp_shard's group; one real group per dim (the old build) holds four more communicators.
    assert row["ray_mesh"]["fake_groups_held"] == 4
    assert row["all_dims_real"]["real_groups_held"] - row["ray_mesh"]["real_groups_held"] == 4
    assert row["ray_mesh"]["real_groups_held"] == row["needed_dims_only"]["real_groups_held"]
    assert any(r[0] == "d mesh build" for r in res["table"])


def test_baton_contenders_take_turns_in_the_rotating_order(tmp_path, monkeypatch):
    """The paired step benchmark's turn-taking, with threads standing in for launchers."""
    import threading

    import pytest

    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.baton import Baton, BatonTimeout, rotating_schedule

    names = ["torchrun", "ray_plain", "ray_mesh"]
    schedule = rotating_schedule(names, 3)
    assert schedule == ["torchrun", "ray_plain", "ray_mesh", "ray_plain", "ray_mesh",
                        "torchrun", "ray_mesh", "torchrun", "ray_plain"]
    ran: list[tuple[int, str]] = []
    errors: list[BaseException] = []

    def contender(name: str) -> None:
        try:
            baton = Baton(str(tmp_path), name, names, schedule, timeout_s=30)
            baton.ready()
            for turn in baton.turns:
                baton.wait_turn(turn)
                ran.append((turn, name))
                baton.pass_on(turn)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(n,)) for n in reversed(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert ran == list(enumerate(schedule))

    # A contender whose partner never shows up fails within its bound, naming the wait.
    lonely = Baton(str(tmp_path / "x"), "ray_mesh", ["torchrun", "ray_mesh"],
                   ["torchrun", "ray_mesh"], timeout_s=0.2)
    (tmp_path / "x").mkdir()
    with pytest.raises(BatonTimeout, match="every contender to warm up"):
        lonely.ready()


def test_pool_of_one_run_equals_that_runs_own_paired_figures(monkeypatch):
    """pool.py over one committed result reproduces the figures run.py wrote for it."""
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.pool import pooled

    path = REPO / "benchmarks" / "results_steps.json"
    steps = json.loads(path.read_text())["steps"]
    rows = pooled([str(path)])
    assert {(w, p) for w, p, *_ in rows} >= {("hsdp", "ray_mesh / torchrun"),
                                             ("tp_pp_mlp", "ray_mesh / ray_plain")}
    for workload, pair, n, med, q1, q3 in rows:
        a, b = pair.split(" / ")
        own = steps[workload][f"{a}_vs_{b}"]
        assert n == own["rounds"]
        assert (med, q1, q3) == (own["median_paired"], own["q1"], own["q3"])


def test_pool_writes_pooled_figures_and_each_runs_median_into_the_json(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.pool import main

    runs = [REPO / "benchmarks" / n for n in ("results_steps.json", "results_steps_repeat.json")]
    out = tmp_path / "results.json"
    out.write_text(json.dumps({"kept": 1}))
    assert main(["--out", str(out), *map(str, runs)]) == 0
    doc = json.loads(out.read_text())
    assert doc["kept"] == 1 and "median of paired" in doc["steps_pooled"]["statistic"]
    row = next(r for r in doc["steps_pooled"]["rows"]
               if (r["workload"], r["pair"]) == ("hsdp", "ray_mesh / torchrun"))
    own = [json.loads(p.read_text())["steps"]["hsdp"]["ray_mesh_vs_torchrun"] for p in runs]
    assert row["rounds"] == sum(o["rounds"] for o in own)
    assert sorted(row["per_run_median"].values()) == sorted(o["median_paired"] for o in own)
    assert row["per_run_range"] == [min(o["median_paired"] for o in own),
                                    max(o["median_paired"] for o in own)]


def test_a_failed_section_exits_nonzero_and_quick_keeps_the_committed_results(tmp_path):
    """`--quick` writes results_quick.json, never results.json; a failed section is rc 1."""
    committed = REPO / "benchmarks" / "results.json"
    quick = REPO / "benchmarks" / "results_quick.json"
    before = committed.read_bytes()
    saved = quick.read_bytes() if quick.exists() else None
    try:
        proc = subprocess.run(  # a rank count torchrun refuses: the section fails fast
            [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--only",
             "meshbuild", "--set", 'meshbuild_sizes=["x"]'],
            capture_output=True, text=True, timeout=240, cwd=str(tmp_path))
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "FAILED sections" in proc.stderr and "meshbuild: failed" in proc.stderr
        res = json.loads(quick.read_text())
        assert res["out"] == "benchmarks/results_quick.json"
        assert res["meshbuild"]["status"].startswith("failed: ")
        assert res["failed"] and res["failed"][0].startswith("meshbuild: failed")
        assert ["d mesh build", "status", res["meshbuild"]["status"], ""] in res["table"]
        assert committed.read_bytes() == before
    finally:
        if saved is None:
            quick.unlink(missing_ok=True)
        else:
            quick.write_bytes(saved)


def test_failures_name_every_missing_figure_and_nothing_else(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks.report import failures

    results = {"steps": {"hsdp": {"ray_mesh_step_s": 0.1},
                         "tp_pp_mlp": {"status": "failed: contenders failed"}},
               "crossnode": {"status": "not run: network namespaces need root"},
               "recovery": {"statistic": "x", "local": {"status": "ok", "recovery_s": 30.0},
                            "netns": {"status": "failed: driver rc 1"}},
               "meshbuild": {"ranks_4": {}}}
    assert failures(results, ["steps", "crossnode", "recovery", "meshbuild", "bringup"]) == [
        "steps.tp_pp_mlp: failed: contenders failed",
        "crossnode: not run: network namespaces need root",
        "recovery.netns: failed: driver rc 1",
        "bringup: no result"]
    assert failures({"meshbuild": {"ranks_4": {}}}, ["meshbuild"]) == []


def test_mixed_nodes_reads_where_each_groups_step_went(tmp_path):
    """The medians behind RESULTS.md's "compute / own boundary / wait" column: steps after
    the warm-up only, a group's own part of the boundary being its commit less its wait."""
    sys.path.insert(0, str(REPO))
    from benchmarks import mixed_nodes as mn

    for gid, (compute, wait) in {0: (0.4, 0.1), 1: (0.5, 0.0)}.items():
        rows = [{"step": s, "ranges": [[s * 10, 4]], "t": float(s), "compute_s": compute,
                 "commit_s": 0.05 + wait, "waited_s": wait} for s in range(1, 10)]
        rows[0]["compute_s"] = 9.0  # a warm-up step: not counted
        (tmp_path / f"g{gid}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = mn.cycle_parts(tmp_path)
    assert got["0"] == pytest.approx({"compute_s": 0.4, "own_boundary_s": 0.05, "wait_s": 0.1})
    assert got["1"] == pytest.approx({"compute_s": 0.5, "own_boundary_s": 0.05, "wait_s": 0.0})
    assert "g0: 0.40 / 0.05 / 0.10" in mn.cycle_text({"cycle": got})


def test_the_smoke_run_is_a_named_subset_the_docs_list():
    """``--quick`` without ``--only`` runs QUICK_SECTIONS (under 10 minutes on 2 cores, its
    wall time in results_quick.json's ``total_s``); every section is still reachable alone
    with ``--quick --only``; the benchmarks page names what the smoke run covers."""
    sys.path.insert(0, str(REPO))
    from benchmarks.run import QUICK_BUDGET_S, QUICK_SECTIONS, SECTIONS

    assert set(QUICK_SECTIONS) < set(SECTIONS) and QUICK_BUDGET_S == 600
    page = (REPO / "docs" / "benchmarks.md").read_text()
    smoke = page[page.index("`--quick` is a smoke run"):].split("Sections:")[0]
    assert all(name in smoke for name in QUICK_SECTIONS), smoke
    assert "--quick --only SECTION" in smoke

