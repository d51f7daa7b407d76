"""The user-job benchmark's runs on the lab (``benchmarks/user_job.py``): its jobs, each a
``ray-mesh run`` from the desktop as ``docs/lab_job.md`` runs it, launched in the background
under the boxes' CPU quotas (the lab's ``box_quotas``, set again on a box Ray is started on
anew), the laptop dropped on a schedule while they go, and the load sampled around them."""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks import user_job_figures as uf
from benchmarks.common import REPO

# The file tests/helpers/heavy.py locks around every heavy test (benchmarks do not import
# tests/; RAY_MESH_HEAVY_LOCK names another, as there).
HEAVY_LOCK = Path(os.environ.get("RAY_MESH_HEAVY_LOCK")
                  or Path(tempfile.gettempdir()) / "ray_mesh_heavy_tests.lock")


def holder(lock: Path) -> str:
    """Who holds the lock, as its holder wrote it."""
    try:
        return lock.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


MESH_TRAIN = f"{REPO / 'benchmarks' / '_user_job_mesh.py'}:train_loop"
BOX_DP = (2, 2, 1)  # desktop, tower, laptop: workers (one CPU each)


@contextlib.contextmanager
def heavy_lock(wait_s: float, name: str = "benchmarks/user_job.py",
               lock: Path | None = None) -> Iterator[None]:
    """Hold the machine-wide lock heavy tests hold (``tests/helpers/heavy.py``; ``lock``
    another file), waiting at most ``wait_s`` for it; unlike a test, a benchmark does not
    run beside another: past the wait it raises ``TimeoutError`` naming the holder."""
    path = lock or HEAVY_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    deadline, told = time.monotonic() + wait_s, False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the heavy-test lock {path} was still held by "
                                       f"{holder(path)} after {wait_s:.0f} s") from None
                if not told:
                    log(f"waiting for {holder(path)} (heavy-test lock, at most "
                        f"{wait_s:.0f} s)")
                    told = True
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {name}".encode(), 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def log(msg: str) -> None:
    print(f"[user_job {time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}",
          file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- jobs
def sync_settings(cfg: dict, mode: str) -> dict:
    """A sync mode's settings: its own (``sync_int8``), else ``sync``'s."""
    return cfg[mode] if mode in cfg else cfg["sync"]


def groups_job(lab, tag: str, cfg: dict, mode: str, groups: Any = None,
               segment: int | None = None, steps_factor: int = 1,
               every: int | None = None) -> tuple[dict, Path]:
    """The page's job (its replica groups) for one run: its own name and step log;
    ``every``: a DiLoCo mode's inner steps per round, if not its settings' (a box alone)."""
    over: dict[str, Any] = {"name": f"lab-{tag}", "replica_groups": {}}
    if mode.startswith("diloco"):  # "diloco", or a DiLoCo mode of its own settings
        d = cfg[mode]
        over["config"] = {"diloco": {"every": every or d["every"],  # compress: the pseudo-gradients
                                     **({"compress": d["compress"]} if "compress" in d else {})}}
        over["replica_groups"].update(steps=d["rounds"] * steps_factor,
                                      segment_samples=d["segment_samples"])
    else:  # "sync", or a sync mode of its own settings (sync_int8: compress int8)
        sync = sync_settings(cfg, mode)
        over["replica_groups"]["steps"] = sync["steps"] * steps_factor
        if "segment_samples" in sync:  # the page's unless a run sets its own
            over["replica_groups"]["segment_samples"] = sync["segment_samples"]
        if "compress" in sync:  # the gradients between groups (replica_groups.compress)
            over["replica_groups"]["compress"] = sync["compress"]
    if groups is not None:
        over["replica_groups"].update(groups=groups, shares="equal", segment_samples=segment)
    job = lab.job(over)
    steps_dir = lab.work / f"{tag}.steps"
    job["config"]["step_log"] = str(steps_dir)
    return job, steps_dir


def mesh_batch(lab, cfg: dict) -> int:
    """The one mesh's global batch: the settings' ``mesh.batch_size``, or by default a step of
    the groups it is compared with under the drops (``segment_samples`` for each box: the
    sync mode's own, as :func:`groups_job` takes it, else the page's), the same samples a
    step."""
    if cfg["mesh"]["batch_size"]:
        return cfg["mesh"]["batch_size"]
    mode = (cfg.get("drops") or {}).get("mode", "sync")
    sync = sync_settings(cfg, "sync" if mode.startswith("diloco") else mode)
    return len(BOX_DP) * sync.get("segment_samples",
                                  lab.page.job["replica_groups"]["segment_samples"])


def mesh_job(lab, tag: str, cfg: dict) -> tuple[dict, Path]:
    """The same job as one mesh: FSDP over one worker per box (ray_mesh refuses a mesh over
    2 + 2 + 1 workers, "the same number on every node", and names this fix:
    ``STRICT_SPREAD``, one worker per node), rows from each box's disk by step, checkpoints
    into the bucket, Ray Train's restarts."""
    from harness.lab_job import EXAMPLE_HEAD

    job = copy.deepcopy(lab.page.job)
    job.pop("replica_groups", None)
    m, steps_dir = cfg["mesh"], lab.work / f"{tag}.steps"
    data = {**job.pop("data"), "batch_size": mesh_batch(lab, cfg)}
    job.update(name=f"lab-{tag}", train=MESH_TRAIN, mesh={"dp_shard": -1},
               scaling={"num_workers": len(BOX_DP), "resources_per_worker": {"CPU": 1},
                        "placement_strategy": "STRICT_SPREAD"})
    job["config"] = {**job["config"], "data": data, "steps": cfg["sync"]["steps"],
                     "checkpoint_every": m["checkpoint_every"], "check_peer_batches": 0,
                     "step_log": str(steps_dir)}
    job["run"] = {**job["run"], "max_failures": m["max_failures"]}
    return json.loads(json.dumps(job).replace(EXAMPLE_HEAD, lab.head_ip)), steps_dir


# ----------------------------------------------------------------------------- running
class Running:
    """One ``ray-mesh run`` of ``job`` from the desktop, as the page runs it, in the
    background (its console in ``work/<tag>.out``)."""

    def __init__(self, lab, tag: str, job: dict, steps_dir: Path) -> None:
        import yaml

        self.tag, self.steps_dir = tag, steps_dir
        steps_dir.mkdir(parents=True, exist_ok=True)
        steps_dir.chmod(0o777)
        path = lab.work / f"{tag}.yaml"
        path.write_text(yaml.safe_dump(job))
        block, line = lab.page.find("ray-mesh run")
        page_file = line.split()[2]
        lines = [x.replace(f"ray-mesh run {page_file}", f"ray-mesh run {path.name}")
                 for x in lab.page.lines(block, "desktop")]
        cmd, env = lab._command(0, lines, lab.work)  # the page's run line, on the desktop
        self.out = lab.work / f"{tag}.out"
        self.t_launch = time.time()
        with self.out.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)

    def done(self) -> bool:
        return self.proc.poll() is not None

    def steps(self) -> list[dict]:
        """The step rows logged so far (every group's, or the one mesh's)."""
        rows = []
        for f in self.steps_dir.glob("*.jsonl"):
            # samples held before a commit (no step yet), and a group's start-up phases
            # (a row of step 0 at each attempt's start, with no commit time)
            if f.name.endswith((".held.jsonl", ".phases.jsonl")):
                continue
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError):  # a line being written
                    row = json.loads(line)
                    if "step" in row and "t" in row:
                        rows.append(row)
        return rows

    def stop(self) -> None:
        if not self.done():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)

    def console(self, tail: int = 4000) -> str:
        return self.out.read_text(errors="replace")[-tail:]


def wait(running: dict[str, Running], t: float, stop_when=None) -> bool:
    """Wait until ``t`` (unix time); False as soon as every run ended or ``stop_when()``."""
    while time.time() < t:
        if all(r.done() for r in running.values()) or (stop_when and stop_when()):
            return False
        time.sleep(0.3)
    return True


def drive(lab, run: Running, drops: dict, until: float) -> list[dict]:
    """Drop the laptop on ``drops``' schedule (from the run's first committed step) while
    ``run`` goes, until it ends or ``until``, each time starting Ray on it again
    ``down_s`` later (the page's step 4) and its CPU quota set again, if it has one."""
    from harness.lab_job import BOXES, LAPTOP

    events: list[dict] = []
    alone = {run.tag: run}
    while not run.steps():  # the schedule starts at the first committed step
        if run.done() or time.time() >= until:
            return events
        time.sleep(0.5)
    t_first = min(r["t"] for r in run.steps())
    block, _ = lab.page.find("ray-mesh run")
    wake = [x for b, part in lab.page.blocks[block + 1] for x in part if b == "laptop"]
    for k, t in enumerate(uf.drop_times(t_first, drops["first_s"], drops["every_s"], until)):
        if not wait(alone, t):
            break
        ev = {"t_kill": time.time(), "t_first_step": t_first}
        lab.cluster.kill_node(LAPTOP)
        ev["kill_took_s"] = time.time() - ev["t_kill"]
        time.sleep(max(0.0, ev["t_kill"] + drops["down_s"] - time.time()))
        ev["t_back"] = time.time()
        ev.update(lab.wake(LAPTOP, wake, f"{run.tag}.{BOXES[LAPTOP]}.wake{k}.log"))
        ev["t_started"] = time.time()
        events.append(ev)
    return events


def train_workers(lab) -> list[int]:
    """The Ray Train worker processes alive on any box."""
    out = []
    for node in lab.cluster.nodes:
        for pid in node.work_pids():
            with contextlib.suppress(OSError):
                if b"RayTrainWorker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
    return out


def run_all(lab, jobs: dict[str, tuple[dict, Path]], timeout_s: float,
            drops: dict | None = None, cut_s: float | None = None,
            stop_when=None, warmup: int | None = None) -> dict[str, dict]:
    """Launch every job at once, drop the laptop on ``drops``' schedule, wait for all (at
    most ``cut_s`` or, as an error, ``timeout_s``), or until ``stop_when(running)``; a run
    stopped by ``cut_s`` or ``stop_when`` is ``cut``. Each run's entry records the CPU
    quotas it ran under (``box_quotas_cores``) and, given ``warmup``, the cores each box
    and the tailnet used over the steps its tokens/s counts (``box_cores``)."""
    lab.cluster.wait_for_nodes(3, timeout_s=180)
    deadline = time.monotonic() + 90  # a stopped run's workers gone (their CPUs free)
    while train_workers(lab) and time.monotonic() < deadline:
        time.sleep(1)
    sampler = uf.LoadSampler([n.ns for n in lab.cluster.nodes], cgroups=lab.cpu_cgroups)
    out: dict[str, dict] = {}
    events: list[dict] = []
    with sampler, head_services_freed(lab):
        running = {tag: Running(lab, tag, job, d) for tag, (job, d) in jobs.items()}
        until = min(r.t_launch for r in running.values()) + (cut_s or timeout_s)
        try:
            if drops:
                events = drive(lab, next(iter(running.values())), drops, until)
            stopped = not wait(running, until, stop_when and (lambda: stop_when(running)))
        finally:
            for r in running.values():
                r.stop()
    load = sampler.summary()
    for tag, r in running.items():
        cut = r.proc.returncode is not None and r.proc.returncode < 0
        if r.proc.returncode != 0 and not (cut and (cut_s or (stop_when and stopped))):
            raise RuntimeError(f"{tag}: ray-mesh run ended with rc {r.proc.returncode}:\n"
                               f"{r.console()}")
        out[tag] = {"t_launch": r.t_launch, "t_end": time.time(), "rc": r.proc.returncode,
                    "cut": cut, "drops": events, "load": load, "steps_dir": str(r.steps_dir),
                    "console": str(r.out), "box_quotas_cores": lab.box_quotas}
        if warmup is not None:
            out[tag]["box_cores"] = counted_box_cores(sampler, r.steps_dir, warmup)
        log(f"{tag}: rc {r.proc.returncode}{' (cut)' if cut else ''}, others' load "
            f"{load['others_runnable_mean']}, 1-min load max {load['loadavg_1m_max']:.1f}")
    return out


@contextlib.contextmanager
def head_services_freed(lab, every_s: float = 0.5):
    """While the runs go: the head's control actors out of the desktop's quota as Ray starts
    them (``Lab.free_head_services``), in the whole job and each box alone alike."""
    stop = threading.Event()

    def sweep() -> None:
        while not stop.wait(every_s):
            lab.free_head_services()

    thread = threading.Thread(target=sweep, daemon=True, name="head-services")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)


def counted_box_cores(sampler, steps_dir: Path, warmup: int) -> dict[str, float | None]:
    """The cores each box (and the tailnet) used over the window tokens/s counts: from step
    ``warmup + 1``'s commit to the last step's (:func:`user_job_figures.tokens_per_s`), read
    from the groups' step logs as that figure reads them."""
    from harness import replica_check

    per = uf.step_samples(replica_check.read(steps_dir))
    steps = sorted(s for s in per if s > warmup)
    if len(steps) < 2:
        return {}
    return {k: v if v is None else round(v, 3)
            for k, v in sampler.box_cores(per[steps[0]][0], per[steps[-1]][0]).items()}


def counted(k: int, warmup: int):
    """``stop_when`` for a box alone: it has committed ``k`` steps after its warm-up (the
    steps :func:`user_job_figures.tokens_per_s` counts)."""
    def check(running: dict[str, Running]) -> bool:
        return all(uf.steps_after_warmup(r.steps(), warmup) >= k for r in running.values())
    return check
