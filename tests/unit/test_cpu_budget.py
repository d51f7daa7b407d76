"""benchmarks/cpu_budget.py: where the machine's CPU goes, per box and process, per step.

The figures themselves live in benchmarks/results.json; here, that the arithmetic is right
and that a real command's CPU is found where it ran.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from benchmarks import cpu_budget as cb


def test_namespaces_name_the_boxes_of_the_virtual_cluster():
    assert cb.box_of("rmn43810n0") == "desktop"
    assert cb.box_of("rmn43810n1") == "tower"
    assert cb.box_of("rmn43810n2") == "laptop"
    assert cb.box_of("host") == "host"
    assert cb.box_of("other-n1") == "other-n1"  # not the lab's namespace


def _steps(tmp_path, times):
    steps = tmp_path / "run-whole.steps"
    steps.mkdir()
    rows = [{"t_proc": 1.0, "step": 0}]  # a start-up row: no "t", not a step
    rows += [{"step": i + 1, "t": t} for i, t in enumerate(times)]
    (steps / "g0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return steps


def test_a_runs_budget_is_core_seconds_per_counted_step(tmp_path):
    s = cb.Sampler()
    s.times = [100.0, 102.0, 104.0, 106.0]
    s.rows = [
        {"1": ("ray::RayTrainWo", "tower", 10.0), "2": ("wireguard-go", "tower", 1.0)},
        {"1": ("ray::RayTrainWo", "tower", 10.5), "2": ("wireguard-go", "tower", 1.2)},
        {"1": ("ray::RayTrainWo", "tower", 11.0), "2": ("wireguard-go", "tower", 1.4),
         "3": ("python", "host", 0.2)},  # started between the samples: all of it counts
        # pid 2 is another process now (its title changed): counted from zero
        {"1": ("ray::RayTrainWo", "tower", 11.6), "2": ("raylet", "tower", 0.1)},
    ]
    # steps at 99 (warm-up), then 102, 104, 106: the window is 102..106, two steps
    got = cb.budget(s, _steps(tmp_path, [99.0, 102.0, 104.0, 106.0]), warmup=1)
    assert got["steps"] == 2 and got["s_per_step"] == 2.0
    assert got["core_s_per_step"]["tower ray::RayTrainWo"] == pytest.approx(0.55)
    assert got["core_s_per_step"]["tower raylet"] == pytest.approx(0.05)
    assert "tower wireguard-go" not in got["core_s_per_step"]  # gone: not in the last sample
    assert got["cores"]["tower"] == pytest.approx((1.1 + 0.1) / 4, abs=1e-3)


def test_a_run_with_fewer_than_two_counted_steps_has_no_budget(tmp_path):
    s = cb.Sampler()
    s.times, s.rows = [1.0, 2.0], [{}, {}]
    assert cb.budget(s, _steps(tmp_path, [1.0, 2.0]), warmup=1) is None


def test_a_commands_cpu_is_found_on_the_host_over_its_steps(tmp_path):
    """End to end: a command that logs a step after each 0.6 s of its own CPU time; that
    CPU is found in the window of its steps, under its own title, on the host (no
    namespace). Steps by CPU time, not wall time: on a busy machine a step only takes
    longer, and the figure per step stays. Its title is its own (the interpreter through a
    link of another name): under the suite, other processes titled ``python`` run too."""
    work = tmp_path / "rmbench_user_job_x"
    script = textwrap.dedent(f"""
        import json, os, time
        os.makedirs({str(work / 'busy.steps')!r})
        with open({str(work / 'busy.steps' / 'g0.jsonl')!r}, "w") as f:
            for step in range(6):
                end = time.process_time() + 0.6
                while time.process_time() < end:
                    pass
                f.write(json.dumps({{"step": step, "t": time.time()}}) + "\\n")
                f.flush()
    """)
    out = tmp_path / "results.json"
    probe = tmp_path / "cpubudgetprobe"  # its process's title (at most 15 characters)
    probe.symlink_to(os.path.realpath(sys.executable))
    rc = cb.main(["--out", str(out), "--key", "k", "--warmup", "1", "--work", str(work), "--",
                  str(probe), "-c", script])
    assert rc == 0
    got = json.loads(out.read_text())["user_job"]["k"]
    assert got["rc"] == 0 and got["command"].startswith(str(probe))
    run = got["runs"]["busy"]
    assert run["steps"] == 4 and run["s_per_step"] >= 0.4, run
    busy = run["core_s_per_step"]["host cpubudgetprobe"]
    # 0.6 core-s a step; the samples inside the window lose at most 0.5 s at each end
    assert 0.3 <= busy <= 0.7, run
    assert run["by_kind"]["host"]["core_s_per_step"] >= busy


def test_processes_are_told_by_what_they_are_for():
    assert cb.kind_of("tower", "ray::RayTrainWorker") == "training_workers"
    assert cb.kind_of("laptop", "wireguard-go") == "tunnel_wireguard_go"
    assert cb.kind_of("desktop", "ray::TrainController") == "head_ray_processes"
    assert cb.kind_of("desktop", "gcs_server") == "head_ray_processes"
    assert cb.kind_of("tower", "raylet") == "other_boxes_ray_processes"
    assert cb.kind_of("host", "python") == "host"
    got = cb.by_kind({"desktop ray::RayTrainWo": 0.8, "tower ray::RayTrainWo": 0.6,
                      "tower wireguard-go": 0.4, "desktop gcs_server": 0.2}, s_per_step=2.0)
    assert got["training_workers"] == {"core_s_per_step": 1.4, "cores": 0.7}
    assert got["tunnel_wireguard_go"]["cores"] == 0.2
    assert got["head_ray_processes"]["core_s_per_step"] == 0.2
