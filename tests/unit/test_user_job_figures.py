"""The user-job benchmark's accounting (benchmarks/user_job_figures.py) and how its section
reads (benchmarks/user_job_md.py): tokens/s and useful tokens from step logs, the one mesh's
lineage under restarts, and the load rule that keeps a busy machine's figure unpublished."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import user_job_figures as uf  # noqa: E402
from benchmarks import user_job_md as md  # noqa: E402
from benchmarks import user_job_runs as ur  # noqa: E402


def _row(step, t, ranges, attempt=0):
    return {"step": step, "t": t, "ranges": ranges, "attempt": attempt}


def test_tokens_per_s_counts_the_steps_after_warmup_over_their_commit_times():
    # two groups, 8 + 4 samples a step, a step a second from t=10; step 1 slow (bring-up)
    logs = {0: [_row(s, 10.0 + s, [[12 * s, 8]]) for s in range(1, 7)],
            1: [_row(s, 10.0 + s - 0.1, [[12 * s + 8, 4]]) for s in range(1, 7)]}
    logs[0][0]["t"] = 0.0
    tps, counted = uf.tokens_per_s(logs, tokens_per_sample=64, warmup=2)
    # steps 3..6 counted from step 3's commit: 3 steps of 12 samples in 3 s
    assert counted == 3
    assert tps == pytest.approx(12 * 64)
    assert uf.mean_shares(logs, 2) == {0: 8.0, 1: 4.0}
    with pytest.raises(ValueError):
        uf.tokens_per_s(logs, 64, warmup=6)


def test_useful_tokens_of_groups_count_each_committed_sample_once():
    logs = {0: [_row(1, 1.0, [[0, 8]]), _row(2, 2.0, [[16, 8]])],
            1: [_row(1, 1.0, [[8, 8]]), _row(2, 2.0, [[24, 4], [28, 4]])]}
    assert uf.groups_useful_tokens(logs, 64) == 32 * 64


def test_mesh_lineage_keeps_the_last_attempt_and_counts_the_redone_steps():
    rows = [{"start": 0, "t": 0}] + [{"step": s, "t": s} for s in range(1, 15)]
    rows += [{"start": 10, "t": 40}] + [{"step": s, "t": 30 + s} for s in range(11, 31)]
    got = uf.mesh_lineage(rows)
    assert got["final_step"] == 30
    assert got["wasted_steps"] == 4  # steps 11..14 of the first attempt
    assert got["attempts"] == [(0, 14), (10, 30)]
    assert uf.mesh_resumes(rows, [20.0]) == [41 - 20.0]
    assert uf.mesh_step_s(rows) == pytest.approx(1.0)


def test_goodput_and_the_drop_schedule():
    assert uf.goodput_per_hour(1000, 100.0, 200.0) == pytest.approx(36_000)
    with pytest.raises(ValueError):
        uf.goodput_per_hour(1000, 100.0, 100.0)
    assert uf.drop_times(0.0, 40, 60, 200) == [40, 100, 160]
    # equal rates; the groups lose 5 s a drop, the mesh 65 s: at 300 s, 0.983 / 0.783
    ratio = uf.goodput_model(100.0, 5.0, 100.0, 65.0, (300.0,))["every_300s"]
    assert ratio == pytest.approx((1 - 5 / 300) / (1 - 65 / 300))
    assert uf.alone_batch(13.6, 2) == 14 and uf.alone_batch(0.4, 2) == 2


def test_a_diloco_box_alone_takes_the_inner_steps_it_took_in_the_whole_job():
    """The whole job of 2026-11-30 (every 16, 128 samples a group): the desktop (2 ranks)
    took 18 inner steps of 8 samples for its 140, the tower 9 for 72, the laptop (1 rank)
    22 for 172. With every 16 over its own share alone, the desktop took 14 steps of 10
    and the tower 12 of 6: other work than the whole job's."""
    from ray_mesh.replicas.shares import inner_steps

    for seg, dp, steps in ((140, 2, 18), (72, 2, 9), (172, 1, 22)):
        per_rank = seg // dp
        ids = list(range(per_rank))
        whole = inner_steps(ids, per_rank, 128, 16, dp)
        alone = inner_steps(ids, per_rank, seg, uf.alone_every(seg, dp, 16, 128), dp)
        assert [len(b) for b in alone] == [len(b) for b in whole] and len(whole) == steps
    assert len(inner_steps(list(range(70)), 70, 140, 16, 2)) == 14  # what it was
    assert uf.alone_every(128, 2, 16, 128) == 16  # a box at the equal share: as set


def test_the_killed_group_and_its_rejoin():
    logs = {0: [_row(s, float(s), [[0, 1]]) for s in range(1, 30)],
            2: [_row(s, float(s), [[0, 1]]) for s in range(1, 11)]
            + [_row(s, float(s), [[0, 1]], attempt=1) for s in range(25, 30)]}
    assert uf.killed_group(logs, 10.5) == 2
    assert uf.rejoin_after(logs, 2, 10.5) == pytest.approx(25 - 10.5)
    # a step of the old attempt committed just after the kill is not the rejoin
    logs[2].insert(10, _row(11, 11.0, [[0, 1]]))
    assert uf.rejoin_after(logs, 2, 10.5) == pytest.approx(25 - 10.5)
    never = {0: logs[0], 2: logs[2][:10]}
    assert uf.killed_group(never, 10.5) == 2 and uf.rejoin_after(never, 2, 10.5) is None


def test_a_figure_with_a_side_at_load_above_2_is_recorded_not_published():
    quiet = {"load": {"others_runnable_mean": 0.4, "loadavg_1m_max": 6.0}}
    busy = {"load": {"others_runnable_mean": 3.1, "loadavg_1m_max": 9.0}}
    runs = {"whole": quiet, "alone": busy, "drops": quiet, "mesh": quiet}
    figs = {"throughput_of_sum_sync": 0.9, "goodput_vs_restart": 1.5}
    sides = {"throughput_of_sum_sync": ["whole", "alone"], "goodput_vs_restart": ["drops",
                                                                                 "mesh"]}
    out = uf.publish(figs, sides, runs, start_load=1.2)
    assert out["throughput_of_sum_sync"] is None
    assert out["recorded"] == {"throughput_of_sum_sync": 0.9}
    assert "alone" in out["invalid"]["throughput_of_sum_sync"]
    assert out["goodput_vs_restart"] == 1.5 and "goodput_vs_restart" not in out["invalid"]
    # a busy machine at the start voids everything; a side that did not run too
    out = uf.publish(figs, {**sides, "goodput_vs_restart": ["drops", "gone"]}, runs, 2.5)
    assert out["goodput_vs_restart"] is None and "gone: not run" in out["invalid"][
        "goodput_vs_restart"]
    assert "when the benchmark started" in out["invalid"]["goodput_vs_restart"]
    # the section shows the reason, never the number
    u = {**out, "status": "ok"}
    assert md.value(u, "throughput_of_sum_sync").startswith("invalid (")
    assert all("0.9" not in r[2] for r in md.rows(u))


def test_the_results_section_is_replaced_in_place(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# results\n\n## Other\n\ntext\n")
    u = {"status": "not run: no namespaces"}
    md.write_section(path, u)
    md.write_section(path, {"status": "not run: again"})
    text = path.read_text()
    assert text.count(md.HEADING) == 1 and "again" in text and "## Other\n\ntext" in text
    path.write_text(text + "\n## Later\n\nkept\n")
    md.write_section(path, u)
    assert "## Later\n\nkept" in path.read_text() and "again" not in path.read_text()


def test_the_load_sampler_tells_its_own_processes_from_others():
    sampler = uf.LoadSampler([])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    # a daemon (its parent gone, adopted by init) is another's
    orphan = subprocess.run(
        ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(30)' >/dev/null 2>&1 & "
         "echo $!"], capture_output=True, text=True, timeout=10)
    other = int(orphan.stdout.split()[0])
    try:
        time.sleep(0.3)
        parents = {}
        for pid in (child.pid, other, os.getpid()):
            stat = Path(f"/proc/{pid}/stat").read_text()
            parents[pid] = int(stat.rsplit(")", 1)[1].split()[1])
        assert sampler._ours(child.pid, parents)
        assert not sampler._ours(other, parents)
        assert isinstance(sampler.sample(), int)
    finally:
        child.kill()
        os.kill(other, 9)
        child.wait(timeout=10)


def test_each_box_alone_is_timed_over_its_own_steps_and_stopped_once_counted():
    # the boxes alone ran one after another: a from t=0, b from t=100 (a step a second),
    # c from t=300 at a step every 2 s; no time in common
    a = {0: [_row(s, float(s), [[s * 10, 4]], attempt="x") for s in range(1, 21)]}
    b = {0: [_row(s, 100.0 + s, [[s * 10, 2]], attempt="y") for s in range(1, 11)]}
    c = {0: [_row(s, 300.0 + 2 * s, [[s * 10, 2]], attempt="z") for s in range(1, 31)]}
    ratio, rates = uf.throughput_of_sum(7.0, {"a": a, "b": b, "c": c}, 1, warmup=2)
    assert rates == {"a": {"tokens_per_s": pytest.approx(4.0), "steps_counted": 17},
                     "b": {"tokens_per_s": pytest.approx(2.0), "steps_counted": 7},
                     "c": {"tokens_per_s": pytest.approx(1.0), "steps_counted": 27}}
    assert ratio == pytest.approx(7.0 / (4 + 2 + 1))
    with pytest.raises(ValueError, match="after the first 9"):  # b never counted 2 steps
        uf.throughput_of_sum(7.0, {"a": a, "b": b}, 1, warmup=9)
    # the stop rule counts what tokens_per_s counts: steps after the warm-up less the first
    assert uf.steps_after_warmup(b[0], 2) == rates["b"]["steps_counted"]
    assert uf.steps_after_warmup(b[0][:3], 2) == 0 and uf.steps_after_warmup([], 2) == 0

    class Run:
        def __init__(self, rows):
            self.rows = rows

        def steps(self):
            return self.rows

    stop = ur.counted(7, warmup=2)
    assert stop({"b": Run(b[0])}) and not stop({"b": Run(b[0][:-1])})
    # attempts are ids: the rejoin is the first step of another id after the kill
    logs = {2: [_row(1, 1.0, [[0, 1]], "b7"), _row(2, 2.0, [[1, 1]], "b7"),
                _row(3, 9.0, [[2, 1]], "a1")]}
    assert uf.rejoin_after(logs, 2, 1.5) == pytest.approx(7.5)


def test_box_quotas_are_checked_and_the_lab_quotas_only_the_tower_by_default(tmp_path,
                                                                           monkeypatch):
    from benchmarks import user_job
    from harness.lab_job import Lab, check_quotas

    assert check_quotas(user_job.SETTINGS["box_quotas_cores"], 2) == {
        "desktop": 0.8, "tower": 0.4, "laptop": 0.4}
    with pytest.raises(ValueError, match=r"\['attic'\], which are no box"):
        check_quotas({"desktop": 0.5, "attic": 0.2}, 2)
    with pytest.raises(ValueError, match="sum to 2 cores, not below the machine's 2"):
        check_quotas({"desktop": 1.0, "tower": 0.5, "laptop": 0.5}, 2)
    for bad in (0, -1, "0.4", None, True):
        with pytest.raises(ValueError, match="a number of cores"):
            check_quotas({"tower": bad}, 2)
    # the benchmark refuses them before it waits for the heavy-test lock (or measures)
    monkeypatch.setattr(user_job.ur, "heavy_lock", lambda *a, **k: pytest.fail("locked"))
    monkeypatch.setattr(user_job, "measure", lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(ValueError, match="which are no box"):
        user_job.locked_measure({**user_job.SETTINGS, "box_quotas_cores": {"attic": 0.1}})
    with pytest.raises(ValueError, match="which are no box"):
        Lab(tmp_path, quotas={"attic": 0.1})
    assert Lab(tmp_path).box_quotas == {"tower": 0.4}  # as tests/netns/test_lab_job.py has it
    assert Lab(tmp_path, tower_cores=0.3).box_quotas == {"tower": 0.3}


def test_the_lab_quotas_each_box_that_has_one_and_on_the_head_only_the_raylets_tree(
        tmp_path):
    from types import SimpleNamespace

    from harness.lab_job import Lab

    # a "raylet" (a shell under that name) with a child, beside a process that is not
    # under it (the head's GCS or bucket)
    raylet = tmp_path / "raylet"
    raylet.write_bytes(Path("/bin/sh").read_bytes())
    raylet.chmod(0o755)
    tree = subprocess.Popen([str(raylet), "-c", "sleep 30 & echo $!; wait"],
                            stdout=subprocess.PIPE, text=True)
    other = subprocess.Popen(["sleep", "30"])
    child = -1
    try:
        child = int(tree.stdout.readline())
        head = SimpleNamespace(ns="d", work_pids=lambda: [other.pid, tree.pid, child])
        nodes = [head] + [SimpleNamespace(ns=n, work_pids=lambda: [11, 12]) for n in "tl"]
        lab = Lab(tmp_path)
        lab.cluster = SimpleNamespace(nodes=nodes, head=head)
        # every box in a cgroup of its own; the tower's with its quota; the head's with
        # all of its processes when it has no quota
        assert lab.quota_plan() == [(0, None, [other.pid, tree.pid, child]),
                                    (1, 0.4, [11, 12]), (2, None, [11, 12])]
        assert lab.quota_plan([2]) == [(2, None, [11, 12])]  # the laptop started anew
        lab = Lab(tmp_path, quotas={"desktop": 0.8, "tower": 0.4, "laptop": 0.4})
        lab.cluster = SimpleNamespace(nodes=nodes, head=head)
        assert lab.quota_plan() == [(0, 0.8, sorted([tree.pid, child])), (1, 0.4, [11, 12]),
                                    (2, 0.4, [11, 12])]
        assert lab.quota_plan([2]) == [(2, 0.4, [11, 12])]
        head.work_pids = lambda: [other.pid]
        with pytest.raises(RuntimeError, match="desktop: no Ray process to put in its cgroup"):
            lab.quota_plan([0])
    finally:
        with contextlib.suppress(ValueError, ProcessLookupError):  # the raylet's child
            os.kill(child, 9)
        for proc in (tree, other):
            proc.kill()
            proc.wait(timeout=10)


def test_the_benchmark_waits_for_the_heavy_lock_and_refuses_past_the_bound(tmp_path):
    import fcntl

    from benchmarks.user_job_runs import heavy_lock

    lock = tmp_path / "heavy.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"pid 1: another heavy test")
    try:
        with pytest.raises(TimeoutError, match="another heavy test"), heavy_lock(0.6,
                                                                               lock=lock):
            pass
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    with heavy_lock(0.6, lock=lock):
        assert lock.read_text().endswith("benchmarks/user_job.py")
    assert lock.read_text() == ""


def test_goodput_compares_both_shapes_over_one_training_window():
    # groups: first step at 100, then a step of 10 samples every 2 s to 160 (60 s); a
    # step's samples are counted once even when two groups log them
    logs = {0: [{"t": 100.0 + 2 * i, "ranges": [[10 * i, 10]]} for i in range(31)],
            1: [{"t": 103.0, "ranges": [[10, 10]]}]}
    # the one mesh: launched at 0, first step at 40, one step a second to step 20, a kill,
    # resumed from step 15 at 80 and on to step 45 (150 s: longer than the groups')
    mesh = [{"start": 0, "t": 38.0}] + [{"step": k, "t": 39.0 + k} for k in range(1, 21)]
    mesh += [{"start": 15, "t": 79.0}] + [{"step": k, "t": 80.0 + k - 16}
                                          for k in range(16, 46)]
    got = uf.same_window(logs, 4, mesh, 100, ([110.0, 200.0], [55.0, 150.0]))
    assert got["window_s"] == pytest.approx(60.0)  # the groups' span, the shorter
    # groups: the 30 steps after the first (300 samples x 4 tokens) in 60 s
    assert got["groups_tokens_per_h"] == pytest.approx(300 * 4 * 3600 / 60)
    # mesh to t = 100: its lineage at step 36 (the resumed attempt), from step 1; the
    # steps 16-20 it took twice count once
    assert got["mesh_tokens_per_h"] == pytest.approx(35 * 100 * 3600 / 60)
    assert got["ratio"] == pytest.approx(1200 / 3500)
    assert got["drops_in_window"] == [1, 1] and got["first_step_t"] == [100.0, 40.0]
    with pytest.raises(ValueError, match="fewer than two steps"):
        uf.same_window(logs, 4, mesh[:2], 100, ([], []))


def test_the_section_shows_every_figure_and_the_runs_behind_it(tmp_path):
    load = {"loadavg_1m_start": 0.5, "loadavg_1m_end": 6.0, "loadavg_1m_max": 6.2,
            "others_runnable_mean": 0.3}
    runs = {"sync-whole": {"tokens_per_s": 900.0, "eval_loss": 2.7, "shares": {0: 8.0},
                           "useful_tokens": 4096, "drops": [], "load": load},
            "groups-drops": {"tokens_per_s": 800.0, "eval_loss": 2.72, "shares": {},
                             "useful_tokens": 3000, "drops": [{}, {}], "load": load,
                             "killed_group": 2, "rejoins_s": [30.5, None],
                             "samples_twice": 0, "samples_skipped": 0,
                             "goodput_tokens_per_h": 7e5},
            "mesh-drops": {"useful_tokens": 1000, "drops": [{}], "load": load,
                           "attempts": [(0, 8), (5, 12)], "wasted_steps": 3,
                           "resumes_s": [39.6], "cut": False, "goodput_tokens_per_h": 3e5}}
    figs = {"throughput_of_sum_sync": 0.91, "survivor_max_step_gap_s": 5.1,
            "survivor_steps_lost": 0, "rejoin_s": 30.5, "final_loss_rel_diff": 0.007,
            "goodput_vs_restart": 2.3}
    sides = {k: ["sync-whole", "groups-drops", "mesh-drops"] for k in figs}
    u = {**uf.publish(figs, sides, runs, start_load=0.4), "status": "ok", "runs": runs,
         "settings": {"drops": {"first_s": 15, "every_s": 45, "down_s": 10}},
         "started": "2026-11-27T06:00:00Z", "wall_s": 480.0, "statistic": "single run",
         "loadavg_1m_at_start": 0.4, "box_quotas_cores": {"desktop": 0.8, "tower": 0.4},
         "goodput_model": {"loss_per_drop_groups_s": 12.0, "loss_per_drop_mesh_s": 60.0,
                           "tokens_per_s_groups": 900.0, "tokens_per_s_mesh": 400.0,
                           "ratio": {"every_300s": 2.7}},
         "goodput_window": {"window_s": 61.25, "groups_tokens_per_h": 7.2e5,
                            "mesh_tokens_per_h": 3.1e5, "drops_in_window": [1, 1]}}
    runs["groups-drops"]["startup_s"], runs["mesh-drops"]["startup_s"] = 70.04, 38.0
    text = md.markdown(u)
    for shown in ("| 0.91 | >= 0.85 |", "| 2.3 | >= 1.3 |", "`mesh-drops`", "[30.5, -]",
                  "every 300s: 2.70", "3 steps redone", "{'desktop': 0.8, 'tower': 0.4}",
                  "boxes alone ran one after another", "the same 61.2 s from their first",
                  "(drops in it: groups 1, one mesh 1): 720,000 against 310,000",
                  "70.0 s (`groups-drops`), 38.0 s (`mesh-drops`)"):
        assert shown in text, shown
    assert len(md.rows(u)) == 6 and "invalid" not in text


def test_a_sync_run_takes_the_settings_segment_samples_or_the_pages(tmp_path):
    """``sync.segment_samples`` (e.g. ``--set '{"sync": {"segment_samples": 32}}'``) sizes the
    whole job's steps; without it the page's job keeps its own."""
    from benchmarks.user_job import SETTINGS, merged
    from harness.lab_job import Lab

    class Page:  # the Lab's job() without a cluster: the page's job and the head's address
        job = {"name": "lab", "config": {}, "replica_groups": {"segment_samples": 8}}

    lab = Lab.__new__(Lab)
    lab.work, lab.page = tmp_path, Page()
    lab.cluster = type("C", (), {"head": type("H", (), {"ip": "100.64.0.1"})()})()
    job, _ = ur.groups_job(lab, "w", SETTINGS, "sync")
    assert job["replica_groups"]["segment_samples"] == 8
    bigger = merged(SETTINGS, {"sync": {"segment_samples": 32}})
    job, _ = ur.groups_job(lab, "w", bigger, "sync")
    assert job["replica_groups"]["segment_samples"] == 32
    assert job["replica_groups"]["steps"] == SETTINGS["sync"]["steps"]
    # the one mesh of the goodput comparison takes the same samples a step as the page's
    # groups (a box each), unless the settings give it a batch of its own
    assert ur.mesh_batch(lab, SETTINGS) == 3 * 8
    Page.job["replica_groups"]["segment_samples"] = 16
    assert ur.mesh_batch(lab, SETTINGS) == 48
    assert ur.mesh_batch(lab, merged(SETTINGS, {"mesh": {"batch_size": 20}})) == 20
    # a run's own segment_samples sizes both sides, as groups_job gives it to the groups
    assert ur.mesh_batch(lab, bigger) == 3 * 32


def test_cores_used_sums_what_processes_in_both_samples_gained():
    series = [(0.0, {1: 10.0, 2: 5.0}), (2.0, {1: 11.0, 2: 5.5}),  # 1.5 s in 2 s
              (4.0, {1: 12.0, 3: 100.0}),  # 2 ended, 3 started: 1 only, +1.0
              (6.0, {1: 12.5, 3: 101.0}), (8.0, {1: 99.0})]  # outside the window
    assert uf.cores_used(series, 0.0, 6.0) == pytest.approx((1.5 + 1.0 + 1.5) / 6.0)
    assert uf.cores_used(series, 1.0, 3.0) is None  # one sample inside: no figure
    assert uf.cores_used([], 0.0, 9.0) is None


def test_cgroup_cpu_s_reads_the_processes_of_a_cgroup_folder(tmp_path):
    (tmp_path / "cgroup.procs").write_text(f"{os.getpid()}\n999999999\n")
    got = uf.cgroup_cpu_s(tmp_path)
    assert list(got) == [os.getpid()] and got[os.getpid()] > 0  # a gone pid is left out
    assert uf.cgroup_cpu_s(tmp_path / "gone") == {}


def test_a_box_whose_raylet_exits_right_after_its_start_is_started_again(tmp_path,
                                                                         monkeypatch):
    """Ray pre-picks the dashboard agent's ports at random; when one is taken by the time
    the agent binds, the raylet exits at once (ray-project/ray#18053): the laptop's second
    restart in a DiLoCo run under drops left its group out for the rest of the run. The
    lab starts the box again, says so, and refuses past ``attempts``."""
    from types import SimpleNamespace

    from harness import lab_job
    from harness.lab_job import Lab

    raylet = tmp_path / "raylet"  # a shell named "raylet": /proc/PID/stat says so
    raylet.write_bytes(Path("/bin/sh").read_bytes())
    raylet.chmod(0o755)
    procs: list[subprocess.Popen] = []
    lives = iter([0, 30, 0, 0])  # seconds each start's raylet stays up

    def sh(box, lines, log, timeout):
        procs.append(subprocess.Popen([str(raylet), "-c", f"sleep {next(lives)}"]))
        return ""

    def kept():
        (tmp_path / "laptop.ray_logs.txt").write_text("== raylet.out\nagent port conflict\n")

    node = SimpleNamespace(ns="l", kill_work=lambda: [p.kill() for p in procs],
                           work_pids=lambda: [p.pid for p in procs if p.poll() is None])
    lab = Lab(tmp_path)
    lab.cluster = SimpleNamespace(nodes=[None, None, node], head=None)
    monkeypatch.setattr(lab, "sh", sh)
    monkeypatch.setattr(lab, "keep_ray_logs", kept)
    monkeypatch.setattr(lab, "throttle", lambda boxes: None)
    try:
        got = lab.wake(lab_job.LAPTOP, ["ray start"], "wake0.log", settle_s=1.5)
        assert got == {"wake_attempts": 2, "wake_failures": ["agent port conflict"]}
        assert (tmp_path / "wake0.log.0.raylet_died.txt").exists()
        for p in procs:  # the lid closed again
            p.kill()
            p.wait(timeout=10)
        with pytest.raises(RuntimeError, match="laptop: its raylet exited right after each "
                                               "of 2 starts.*agent port conflict"):
            lab.wake(lab_job.LAPTOP, ["ray start"], "wake1.log", settle_s=1.0)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


def test_a_survivors_pause_under_diloco_is_read_from_its_inner_steps(tmp_path):
    """A DiLoCo group commits once a round: its committed steps, 10 s apart, would read as a
    10 s pause; its optimizer steps (``g<i>.inner.jsonl``) show the real one."""
    from harness import replica_check as rc

    for gid in (0, 1):
        (tmp_path / f"g{gid}.jsonl").write_text("".join(
            json.dumps({"step": s, "t": 10.0 * s, "ranges": []}) + "\n" for s in (1, 2, 3)))
        inner = [1.0 * k for k in range(31) if not (gid == 0 and 12 < k < 16)]
        (tmp_path / f"g{gid}.inner.jsonl").write_text("".join(
            json.dumps({"step": int(t // 10), "t": t, "attempt": "a"}) + "\n" for t in inner))
    assert rc.survivor_gaps(rc.read(tmp_path), killed=1, t_kill=11.0) == 10.0
    assert rc.survivor_gaps(rc.read_inner(tmp_path), killed=1, t_kill=11.0) == 4.0
    assert sorted(rc.read(tmp_path)) == [0, 1]  # the inner log is not read as commits


def test_a_figure_of_several_runs_says_so_and_a_lower_bound_of_any_goodput_too():
    u = {"throughput_of_sum_diloco": 0.80, "goodput_vs_restart_diloco": 3.68,
         "goodput_vs_restart_diloco_is_lower_bound": True, "rejoin_s": 44.8,
         "medians": {"throughput_of_sum_diloco": {"values": [0.80, 0.92, 0.78], "why": "x"}}}
    got = {figure: (v, target) for _, figure, v, target in md.rows(u)}
    assert got["diloco: whole job tokens/s / sum of each box alone (median of 3 runs)"] == (
        "0.8", ">= 0.92")
    assert got["DiLoCo: useful tokens/h, replica groups / one mesh with checkpoint-restart "
               "(each from its launch) (single run)"] == (
        ">= 3.68 (the one mesh did not finish)", ">= 1.3")
    assert got["laptop dropped: first drop -> its group's next step, s (Ray back included) "
               "(single run)"] == ("44.8", "report")


def test_the_heads_control_actors_are_told_from_the_training_workers():
    """What the benchmark moves out of the desktop's quota (harness.lab_job.HEAD_SERVICES):
    the titles seen in a three-group run's desktop cgroup, 2026-11-30."""
    from harness.lab_job import head_service

    for title in (b"ray::TrainController.run", b"ray::Coordinator", b"ray::DatasetManager",
                  b"ray::PlacementGroupCleaner", b"ray::SynchronizationActor\x00",
                  b"ray::TrainStateActor", b"ray::_AutoscalingCoordinatorActor"):
        assert head_service(title), title
    for title in (b"ray::RayTrainWorker", b"ray::RayTrainWorker.run_train_fn", b"ray::IDLE",
                  b"ray::DashboardAgent", b"/usr/bin/raylet\x00--node", b"python\x00-u", b""):
        assert not head_service(title), title


@pytest.mark.parametrize("twice", [True, False])
def test_the_whole_job_runs_again_after_the_boxes_alone_and_the_ratio_takes_their_mean(
        tmp_path, monkeypatch, twice):
    """``whole_twice``: the machine's speed drifts between a run's whole job and its boxes
    alone, so the whole job runs before and after them and the ratio is over the mean."""
    from types import SimpleNamespace

    from benchmarks import user_job

    launched = []
    rates = {"sync-whole": 900.0, "sync-whole-after": 700.0}

    def groups_job(lab, tag, cfg, mode, *a, **k):
        return ({"name": tag}, tmp_path / tag)

    def run_all(lab, jobs, timeout_s, **k):
        (tag,) = jobs
        launched.append(tag)
        steps = tmp_path / tag
        steps.mkdir()
        if "alone" in tag:  # 100 tokens/s: a step of 10 samples x 10 tokens a second
            rows = [_row(s, float(s), [[10 * s, 10]]) for s in range(1, 21)]
            (steps / "g0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        return {tag: {"steps_dir": str(steps)}}

    def read_groups(run, seq_len, warmup):
        tag = Path(run["steps_dir"]).name
        return {**run, "tokens_per_s": rates[tag],
                "shares": {0: 8.0, 1: 2.0, 2: 6.0},
                "layouts": {g: {"node": f"10.0.0.{g}"} for g in range(3)}}

    monkeypatch.setattr(user_job.ur, "groups_job", groups_job)
    monkeypatch.setattr(user_job.ur, "run_all", run_all)
    monkeypatch.setattr(user_job.ur, "log", lambda *a: None)
    monkeypatch.setattr(user_job, "read_groups", read_groups)
    lab = SimpleNamespace(cluster=SimpleNamespace(
        nodes=[SimpleNamespace(ip=f"10.0.0.{g}") for g in range(3)]))
    cfg = {**user_job.SETTINGS, "whole_twice": twice}
    got = user_job.throughput(lab, cfg, "sync", seq_len=10)
    alone = ["sync-alone0", "sync-alone1", "sync-alone2"]
    wholes = ["sync-whole", "sync-whole-after"] if twice else ["sync-whole"]
    assert launched == ["sync-whole", *alone, *wholes[1:]]  # the alone runs in between
    assert got["sides"]["throughput_of_sum_sync"] == [*wholes, *alone]
    mean = (900.0 + 700.0) / 2 if twice else 900.0
    assert got["figures"]["throughput_of_sum_sync"] == pytest.approx(mean / 300.0)
