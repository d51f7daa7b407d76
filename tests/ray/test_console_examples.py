"""Every example the README and docs/*.md show as a command, run as a user runs it, with a
console a person can read: no warning, traceback, error, port -1 or sampler failure that is
not expected (tests/helpers/console.py names the expected ones and why).

Each ``ray-mesh run examples/X.yaml`` runs as a cluster user runs it, ``--address`` joining a
running Ray (the session's ``ray_local``), on a short copy of the example's YAML (few steps, a
small model: the console, not the training, is under test; the training is tested in
test_parallel_examples.py, test_llm_ray.py, ...). The console of an embedded Ray (its start
and stop, what a user without a cluster sees) is checked on the README's main job
(test_main_job.py), a full run. The python driver's console is checked on a cluster by the
deploy walkthrough (tests/netns/test_walkthrough.py runs ``python examples/driver.py
--address ...`` as the page shows it); its run on an embedded Ray, ``python
examples/driver.py --steps N`` below, is in the slow tier. An embedded Ray's start and stop
cost ~15-25 s per job on this 2-core machine, which is why the other examples do not repeat
them.

``RAY_MESH_CONSOLE_OUT=DIR`` keeps every console.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import yaml
from console import ANSI, EXPECTED, lines, problems
from llm_job import check_run

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

pytestmark = pytest.mark.ray

# A short run of every example: config overrides (merged into config:), and other sections.
SHORT: dict[str, dict] = {
    "tp_pp_mlp": {"config": {"steps": 6, "report_every": 2}},
    "fsdp_tp_transformer": {"config": {"steps": 6, "report_every": 2}},
    "pp_hsdp_tp": {"config": {"steps": 4, "report_every": 2}},
    "hsdp_checkpoint": {"config": {"steps": 6, "checkpoint_every": 3}},
    "diloco": {"config": {"steps": 6, "checkpoint_every": 3},
               "replicate": {"every": 3}},
    # check_peer_batches 1: the example compares the batch over the tp group at every step
    # and raises if tp peers got different rows (test_llm_console_... below).
    "llm": {"config": {"model": {"preset": "tiny", "max_seq_len": 64}, "steps": 6,
                       "report_every": 2, "eval_every": 6, "checkpoint_every": 6, "warmup": 2,
                       "check_peer_batches": 1},
            "data": {"seq_len": 32, "batch_size": 8, "max_tokens": 60_000,
                     "val_tokens": 4096}},
    # replica groups of 2 and 1 workers reading the LM's text by sample index
    # (test_llm_groups_console_... below); steps are replica_groups.steps; the gradients
    # between the groups as int8 (replica_groups.compress: the job key through the launch
    # layer and fit_replica_groups to each group's ReplicaGroup, under Ray)
    "llm_groups": {"config": {"model": {"preset": "tiny", "max_seq_len": 64},
                              "report_every": 2, "eval_every": 6, "warmup": 2},
                   "data": {"seq_len": 32, "max_tokens": 60_000, "val_tokens": 4096},
                   "replica_groups": {"steps": 6, "segment_samples": 4, "compress": "int8"}},
}
DRIVER_STEPS = 6
# Examples whose full run is already a test that checks its console with the same checker:
# running them again here would only repeat a run (~35-50 s each).
COVERED_ELSEWHERE = {"hsdp": "tests/ray/test_main_job.py",
                     "hsdp_metrics": "tests/ray/test_metrics_dashboard.py",
                     "replica_groups": "tests/ray/test_replica_groups_ray.py"}


def shown_commands() -> set[str]:
    """Example names the README and docs show as ``ray-mesh run examples/X.yaml``, or list
    under "Examples (each: `ray-mesh run examples/NAME.yaml` ...)", plus ``driver`` when a page
    shows ``examples/driver.py``."""
    names: set[str] = set()
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        names |= {n for n in re.findall(r"ray-mesh run examples/(\w+)\.yaml", text)
                  if (EXAMPLES / f"{n}.yaml").exists()}  # not the placeholder NAME
        for block in re.findall(r"Examples \(each: `ray-mesh run examples/NAME\.yaml`.*?\n\n",
                                text, flags=re.S):
            names |= {n for n in re.findall(r"`(\w+)`", block) if (EXAMPLES / f"{n}.yaml")
                      .exists()}
        if "examples/driver.py" in text:
            names.add("driver")
    return names


def test_every_example_shown_has_a_console_check():
    shown = shown_commands()
    assert {"hsdp", "llm", "diloco", "driver"} <= shown, shown  # the parser still finds them
    covered = {*SHORT, *COVERED_ELSEWHERE, "driver"}
    assert shown <= covered, f"add a short config to SHORT for {shown - covered}"


def test_examples_covered_elsewhere_are_checked_there():
    for name, test in COVERED_ELSEWHERE.items():
        text = (ROOT / test).read_text()
        assert f"examples/{name}.yaml" in text and "problems(out)" in text, (name, test)


def _short_job(name: str, tmp: Path) -> Path:
    job = yaml.safe_load((EXAMPLES / f"{name}.yaml").read_text())
    short = SHORT[name]
    job["config"] = {**(job.get("config") or {}), **short.get("config", {})}
    for section in ("data", "replicate", "replica_groups"):
        if section in short:
            job[section] = {**(job.get(section) or {}), **short[section]}
    file, _, fn = job["train"].partition(":")
    job["train"] = f"{EXAMPLES / file}:{fn}"
    job.setdefault("run", {})["storage_path"] = str(tmp / "results")
    if "data" in job and job["data"].get("paths") != ["stdlib"]:
        raise AssertionError(f"{name}: data paths are relative to examples/; handle them here")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _run(cmd: list[str], timeout: int, dedup: bool = True) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    if not dedup:  # every line as the workers wrote it: a line shown twice is seen
        env["RAY_DEDUP_LOGS"] = "0"
    # Without --address: its own embedded Ray in a short dir (Ray's socket paths must stay
    # under 107 bytes). A report waits for Ray Train's controller to look at the workers,
    # every 2 s by default; nothing printed depends on it.
    env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = "0.2"
    ray_tmp = tempfile.mkdtemp(prefix="rmc-", dir="/tmp")
    env["RAY_TMPDIR"] = ray_tmp
    # This checkout on the driver and on Ray's workers (an installed ray_mesh may be another).
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    out = proc.stdout + proc.stderr
    keep = os.environ.get("RAY_MESH_CONSOLE_OUT")  # a folder: keep each console to read
    if keep:
        name = Path(cmd[-1]).stem if cmd[-1].endswith(".yaml") else "driver"
        Path(keep, f"{name}.log").write_text(out)
    assert proc.returncode == 0, out[-5000:]
    return out


def _check(out: str, name: str, steps: int) -> None:
    bad = problems(out)
    shown = lines(out)
    # with the lines before the first one: a C++ stack's frames name no message of their own
    first = shown.index(bad[0]) if bad else 0
    assert not bad, "unexpected console lines:\n" + "\n".join(bad[:40]) + \
        "\n--- the console before the first of them:\n" + "\n".join(shown[max(0, first - 15):first])
    progress = [x for x in shown if re.match(rf"[\w.-]+: step \d+/{steps} loss ", x)]
    assert progress and progress[-1].startswith(f"{name}: step {steps}/{steps} "), \
        "\n".join(shown[-60:])
    assert not [x for x in shown if "metrics:" in x and ":-1" in x], out[-2000:]


def _run_example(name: str, ray_local, tmp_path: Path) -> str:
    gcs = ray_local.get_runtime_context().gcs_address
    out = _run([sys.executable, "-m", "ray_mesh.cli.main", "run", "--address", gcs,
                str(_short_job(name, tmp_path))], timeout=840)
    assert f"ray-mesh: run '{name}' finished" in out, out[-3000:]
    _check(out, name, SHORT[name]["config"]["steps"])
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(set(SHORT) - {"llm", "llm_groups"}))
def test_example_console_is_clean(name, ray_local, tmp_path):
    _run_example(name, ray_local, tmp_path)


@pytest.mark.timeout(900)
def test_llm_console_is_clean_and_tp_peers_read_the_same_rows(ray_local, tmp_path):
    """The LM job as shipped (dp_shard 2 x tp 2): ``MeshConfig`` splits its Ray Data by dp
    rank (``MeshDataConfig``), so both tp peers of a dp rank read the same rows; the
    example's peer guard (every step here) raises on the first step whose batches differ
    -- as Ray's default split by world rank gives -- so a finished run is the proof. The
    loss falls, the eval line and the sharded checkpoint are there."""
    out = _run_example("llm", ray_local, tmp_path)
    steps = SHORT["llm"]["config"]["steps"]
    assert "(dp 2 x tp 2)" in out, out[-3000:]
    check_run(out, name="llm", steps=steps, report=SHORT["llm"]["config"]["report_every"],
              storage=tmp_path / "results")


@pytest.mark.timeout(900)
def test_llm_groups_console_is_clean_and_shows_tokens_per_s(ray_local, tmp_path):
    """``ray-mesh run examples/llm_groups.yaml`` with ``data_from: ray_data``: the LM as
    replica groups of 2 and 1 workers, each reading by sample index the rows the driver
    read once into the object store. A clean console, each group's progress line with
    tokens/s, both groups' evaluation, the summary's tokens/s. With Ray's log deduplication
    off, each line a group's worker printed shows once: the groups' fit() runs in runner
    actors, which on a cluster did not have the driver's Ray Train settings, so Ray Train's
    print patch logged and echoed every print. The example's default, ``data_from: files``
    (each group from its node's files, checked against the driver's manifest), is the
    lab job's: tests/netns/test_lab_job.py runs it on three boxes with the same checks."""
    path = _short_job("llm_groups", tmp_path)
    job = yaml.safe_load(path.read_text())
    job["replica_groups"]["data_from"] = "ray_data"
    path.write_text(yaml.safe_dump(job))
    gcs = ray_local.get_runtime_context().gcs_address
    out = _run([sys.executable, "-m", "ray_mesh.cli.main", "run", "--address", gcs,
                str(path)], timeout=840, dedup=False)
    steps = SHORT["llm_groups"]["replica_groups"]["steps"]
    assert f"ray-mesh: run 'llm_groups' finished: {steps} steps of 2 replica group(s)" in out, \
        out[-3000:]
    bad = problems(out)
    assert not bad, "unexpected console lines:\n" + "\n".join(bad[:40])
    shown = lines(out)
    for gid in (0, 1):
        assert any(re.match(rf"llm_groups-g{gid}: step {steps}/{steps} loss .*tokens/s", x)
                   for x in shown), "\n".join(shown[-60:])
        assert any(x.startswith(f"  group {gid} (dp_shard={2 - gid}): ") and "tokens/s" in x
                   for x in shown), "\n".join(shown[-20:])
    assert sum(f"llm: eval at step {steps}: val loss" in x for x in shown) == 2, shown[-60:]
    # what the groups' rank 0 printed, with the process that printed it: each line once
    printed = Counter(x for x in (ANSI.sub("", y) for y in out.splitlines())
                      if x.startswith("(RayTrainWorker pid=") and ") llm: " in x)
    assert printed and max(printed.values()) == 1, printed
    assert any(x.startswith("  throughput:  ") and "tokens/s" in x for x in shown), shown[-20:]
    assert "training rows read into the object store" in out, out[-3000:]


# Slow tier (~32 s): the driver's console on a cluster is the walkthrough's (default tier),
# an embedded Ray's console the main job's (test_main_job.py).
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_python_driver_console_is_clean():
    out = _run([sys.executable, str(EXAMPLES / "driver.py"), "--steps", str(DRIVER_STEPS)],
               timeout=840)
    assert "driver: finished" in out, out[-3000:]
    _check(out, "hsdp-driver", DRIVER_STEPS)


def test_expected_lines_say_why():
    assert all(e.why and len(e.why) > 30 for e in EXPECTED)
