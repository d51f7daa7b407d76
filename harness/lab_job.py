"""The "Your lab's job" page (docs/lab_job.md), run on a virtual cluster: its runner.

The page's ``bash`` blocks are split at their box headings (``# desktop``, ``# tower``,
``# laptop``; text after a colon is a comment) and its ``yaml`` block is the job. A
:class:`Lab` builds three namespace nodes joined by real WireGuard, each with its own disk
(``NetnsCluster(start_ray=False)``: no Ray but what the page starts), each box's processes
in a CPU cgroup of its own, some under CPU quotas (``quotas``, cores per box; by default the
tower, node 1, the older box, at ``tower_cores`` and the others free; see
:meth:`Lab.throttle`), and runs the page on them with ``100.101.102.103`` replaced by the
head's tailnet address:

* :meth:`Lab.start`: step 1, each box's lines on that box (then its cgroup and quota);
* :meth:`Lab.plan`: step 2;
* :meth:`Lab.run_job`: step 3, the page's ``ray-mesh run`` in the head's namespace in the
  background, the job written where the page says to save it with two changes for the
  measurement (``train:`` names ``harness/lab_train.py``, the same loop with a step log, and
  ``config.step_log``; ``overrides`` for a benchmark's longer run), and while it runs, the
  lid: every process of the laptop killed once a group committed ``kill_step``, and step
  4's lines run on it ``down_s`` later. ``kill="all"``: every group at once instead (the
  tower's and laptop's processes, and the desktop's group workers; the driver and the
  bucket stay), both boxes started again ``down_s`` later;
* :meth:`Lab.status`: step 5.

:func:`figures` reads the run's step log (``harness/replica_check.py``) into the figures
a test checks and a benchmark records. The driver, ``ray-mesh run``, prints what a user
sees; the console is kept in ``run.out``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from harness import replica_check
from harness.netns import REPO, NetnsCluster
from harness.netns.cpu import CPU_ROOT, in_cgroup, make_cgroup, remove_cgroup

PAGE = REPO / "docs" / "lab_job.md"
EXAMPLE_HEAD = "100.101.102.103"
BOXES = ("desktop", "tower", "laptop")  # nodes 0, 1, 2
TOWER, LAPTOP = 1, 2
TRAIN = f"{REPO / 'harness' / 'lab_train.py'}:train_groups"
READY = "ray-mesh storage: serving"


@dataclass
class Page:
    """The page's commands: ``blocks[i]`` is the i-th bash block as (box, lines) parts."""

    blocks: list[list[tuple[str, list[str]]]]
    job: dict[str, Any]

    def lines(self, block: int, box: str) -> list[str]:
        return [x for b, part in self.blocks[block] for x in part if b == box]

    def find(self, prefix: str) -> tuple[int, str]:
        """(block, line) of the first command that starts with ``prefix``."""
        for i, block in enumerate(self.blocks):
            for _, part in block:
                for line in part:
                    if line.startswith(prefix):
                        return i, line
        raise LookupError(f"docs/lab_job.md has no command starting with {prefix!r}")


def read_page(path: Path = PAGE) -> Page:
    text = path.read_text()
    blocks = []
    for body in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        parts: list[tuple[str, list[str]]] = []
        for line in body.replace("\\\n", " ").splitlines():
            stripped = line.strip()
            if stripped.startswith("#"):
                box = re.split(r"[:(]", stripped.lstrip("# "))[0].strip()
                if box not in BOXES:
                    raise ValueError(f"{path.name}: a bash block's heading {stripped!r} names "
                                     f"no box of {BOXES}")
                parts.append((box, []))
                continue
            command = re.sub(r"\s+#.*$", "", stripped)
            if command:
                if not parts:
                    raise ValueError(f"{path.name}: {command!r} comes before any box heading")
                parts[-1][1].append(re.sub(r"\s+", " ", command))
        blocks.append(parts)
    (job_text,) = re.findall(r"```yaml\n(.*?)```", text, flags=re.S)
    return Page(blocks, yaml.safe_load(job_text))


def machine_cores() -> int:
    """The CPUs this process may run on (the machine's, unless pinned)."""
    return len(os.sched_getaffinity(0))


def check_quotas(quotas: Mapping[str, float], cores: float) -> dict[str, float]:
    """``quotas`` (CPU cores per box name) as a :class:`Lab` applies them, or a
    ``ValueError`` that says what is wrong: a name that is no box, a quota that is no number
    of at least 0.01 cores, or quotas that sum to the machine's ``cores`` or more (nothing
    would be left for what runs outside every quota: the driver, the head's GCS and bucket,
    wireguard-go)."""
    unknown = sorted(set(quotas) - set(BOXES))
    if unknown:
        raise ValueError(f"CPU quotas name {unknown}, which are no box: the boxes are "
                         f"{list(BOXES)}")
    bad = {b: c for b, c in quotas.items()
           if isinstance(c, bool) or not isinstance(c, int | float) or not c >= 0.01}
    if bad:
        raise ValueError(f"CPU quotas {bad}: each must be a number of cores, at least 0.01")
    total = sum(quotas.values())
    if total >= cores:
        raise ValueError(f"CPU quotas {dict(quotas)} sum to {total:g} cores, not below the "
                         f"machine's {cores:g}: nothing would be left for the driver, the "
                         "GCS, the bucket and wireguard-go outside them")
    return dict(quotas)


HEAD_SERVICES = frozenset({
    "ray::TrainController", "ray::Coordinator", "ray::PlacementGroupCleaner",
    "ray::DatasetManager", "ray::SynchronizationActor", "ray::TrainStateActor",
    "ray::_AutoscalingCoordinatorActor"})
"""The process titles (before a method's name) of the actors a run's driver starts on the
head for every group: Ray Train's per-run actors and ray_mesh's coordinator
(:meth:`Lab.free_head_services`)."""


def head_service(cmdline: bytes) -> bool:
    """Whether a process's ``/proc/PID/cmdline`` is one of :data:`HEAD_SERVICES`' (a Ray
    worker's title is ``ray::Class`` or, in a method, ``ray::Class.method``)."""
    title = cmdline.split(b"\0")[0].decode(errors="replace").strip()
    return title.split(".")[0] in HEAD_SERVICES


def _under_raylet(pids: list[int]) -> list[int]:
    """Of ``pids``, the raylets' and every process under them (parents from /proc)."""
    parent, keep = {}, set()
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            name, parent[pid] = _stat(pid)
            if name == "raylet":
                keep.add(pid)
    while more := {p for p, pp in parent.items() if pp in keep} - keep:
        keep |= more
    return sorted(keep)


def _stat(pid: int) -> tuple[str, int]:
    """A process's command name and parent pid, from /proc (raises OSError once it is gone)."""
    head, tail = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)
    return head.split("(", 1)[1], int(tail.split()[1])


def _raylet(pids: list[int]) -> bool:
    """Whether one of ``pids`` is a raylet (by its command name in /proc)."""
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            if _stat(pid)[0] == "raylet":
                return True
    return False


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@dataclass
class Lab:
    """Three boxes of the page on a virtual cluster (see the module docstring)."""

    work: Path
    tower_cores: float = 0.4
    # CPU cores per box name (``BOXES``); None: the tower at ``tower_cores``, no other quota
    quotas: Mapping[str, float] | None = None
    page: Page = field(default_factory=read_page)
    cluster: NetnsCluster | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_quotas(self.box_quotas, machine_cores())

    @property
    def box_quotas(self) -> dict[str, float]:
        """The CPU quota of each box that has one, in cores, by box name."""
        return dict(self.quotas) if self.quotas is not None else {"tower": self.tower_cores}

    def __enter__(self) -> Lab:
        self.work.mkdir(parents=True, exist_ok=True)
        self.work.chmod(0o777)
        self.cluster = NetnsCluster([{}, {}, {}], start_ray=False)
        self.cluster.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cluster is not None:
            if exc[0] is not None:
                self.keep_ray_logs()
            self.cluster.stop()
            for name in [n.ns for n in self.cluster.nodes] + [self._tailnet_cgroup]:
                remove_cgroup(CPU_ROOT / name)

    def keep_ray_logs(self) -> None:
        """Each box's Ray logs' tails into ``work`` (the boxes' disks go with the cluster)."""
        for box in range(len(BOXES)):
            with contextlib.suppress(Exception):
                got = self.cluster.run_in(box, ["sh", "-c", (
                    "cd /tmp/ray-mesh-node/tmp/ray/session_latest/logs && for f in "
                    "gcs_server.out raylet.out raylet.err dashboard_agent.log; do "
                    "[ -f $f ] && echo \"== $f\" && tail -n 40 $f; done")], timeout=20)
                (self.work / f"{BOXES[box]}.ray_logs.txt").write_text(got.stdout + got.stderr)

    def quota_plan(self, boxes: Iterable[int] | None = None
                   ) -> list[tuple[int, float | None, list[int]]]:
        """(box, its quota in cores or None, its Ray processes now) for each of ``boxes``
        (default: all): what :meth:`throttle` sets. A box's Ray processes are all of its
        processes but its machinery, except on a head (the desktop) with a quota, where the
        GCS, the dashboard and the bucket serve every box and stay outside the quota, as the
        driver does: there, the raylet and every process under it (its workers)."""
        plan = []
        quotas = self.box_quotas
        for box in range(len(BOXES)) if boxes is None else boxes:
            node, cores = self.cluster.nodes[box], quotas.get(BOXES[box])
            pids = (_under_raylet(node.work_pids())
                    if node is self.cluster.head and cores is not None else node.work_pids())
            if not pids:
                raise RuntimeError(f"{BOXES[box]}: no Ray process to put in its cgroup")
            plan.append((box, cores, pids))
        return plan

    def throttle(self, boxes: Iterable[int] | None = None) -> None:
        """Each of ``boxes`` (default: all): its Ray processes (and all they start) in a
        weighted cgroup of its own (``harness/netns/cpu.py``: the largest weight under a
        quota, four processes' worth without one), under its CPU quota if it has one
        (``box_quotas``; by default the tower, the older box). A box is a machine of its
        own: a CPU hog beside it takes only a small part of the box's CPU, so two hogs do
        not make the desktop as slow as the tower, whose quota caps it however idle the
        machine is. Set once its Ray is up (:meth:`quota_plan`), so that the tower's ``ray
        start`` does not take the test's time, and again when a box is started anew."""
        moves = [(make_cgroup(self.cluster.nodes[box].ns, cores), pids)
                 for box, cores, pids in self.quota_plan(boxes)]
        if boxes is None:  # the tailnet's wireguard-go processes, at a box's weight too:
            # beside boxes of that weight, at the default one they carried every byte
            # between the boxes a few hundredths of a core at a time (the lab's steps and
            # start-up ~20% slower)
            moves.append((make_cgroup(self._tailnet_cgroup, None),
                          sorted(p for n in self.cluster.nodes for p in n.infra_pids)))
        for group, pids in moves:
            for pid in pids:
                with contextlib.suppress(OSError):
                    (group / "cgroup.procs").write_text(str(pid))

    def free_head_services(self) -> list[int]:
        """Move the head's Ray Train control actors (:data:`HEAD_SERVICES`) out of the
        desktop's quota, beside the GCS and the dashboard; returns the pids moved.

        They serve every group of a run, not the desktop's training: a controller, a
        placement-group cleaner, a dataset manager and a synchronization actor per group,
        the run's coordinator. Inside the quota they took ~0.18 of the desktop's 0.8 cores
        in a three-group run (~0.10 with one group alone: measured per process, 2026-11-30),
        so the desktop trained slower in the whole job than alone for work a real head does
        on cores its GPU training leaves idle. Ray starts them after :meth:`throttle`, under
        the raylet (so in its cgroup): call this again while a run starts them."""
        box = BOXES[self.cluster.nodes.index(self.cluster.head)]
        if box not in self.box_quotas:
            return []
        try:  # the processes still in its quota's cgroup (those moved before are not)
            pids = (self.cpu_cgroups[box] / "cgroup.procs").read_text().split()
        except OSError:  # not made yet, or gone with the cluster
            return []
        moved = []
        for pid in pids:
            with contextlib.suppress(OSError):
                if head_service(Path(f"/proc/{pid}/cmdline").read_bytes()):
                    (CPU_ROOT / "cgroup.procs").write_text(str(pid))
                    moved.append(int(pid))
        return moved

    @property
    def _tailnet_cgroup(self) -> str:
        return f"{self.cluster.head.ns}-tailnet"

    @property
    def cpu_cgroups(self) -> dict[str, Path]:
        """The CPU cgroup folders :meth:`throttle` puts processes in: each box's, by its
        name, and the tailnet's (``tailnet``)."""
        return {**{BOXES[i]: CPU_ROOT / n.ns for i, n in enumerate(self.cluster.nodes)},
                "tailnet": CPU_ROOT / self._tailnet_cgroup}

    # ------------------------------------------------------------------ the boxes
    @property
    def head_ip(self) -> str:
        return self.cluster.head.ip

    def _command(self, box: int, lines: list[str], cwd: Path) -> tuple[list[str], dict]:
        node = self.cluster.nodes[box]
        script = "set -euo pipefail\ncd " + str(cwd) + "\n" + "\n".join(
            x.replace(EXAMPLE_HEAD, self.head_ip) for x in lines) + "\n"
        cmd = [*node.exec_prefix(), "bash", "-c", script]
        group = CPU_ROOT / node.ns  # once :meth:`throttle` made it: run on that box's CPU
        if group.exists() and BOXES[box] not in self.box_quotas:  # (a quota: Ray's alone)
            cmd = in_cgroup(group, cmd)
        env = {**self.cluster.node_env(node), "PYTHONPATH": str(REPO),
               "PYTHONUNBUFFERED": "1"}
        return cmd, env

    def sh(self, box: int, lines: list[str], log: str, timeout: float,
           cwd: Path = REPO) -> str:
        """Run ``lines`` as one bash script on ``box``; output to ``work/log`` (a line that
        leaves a server in the background keeps its output open)."""
        cmd, env = self._command(box, lines, cwd)
        path = self.work / log
        with path.open("w") as out:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                  timeout=timeout)
        text = path.read_text()
        if proc.returncode != 0:
            raise RuntimeError(f"{BOXES[box]} (rc {proc.returncode}), {lines}:\n{text[-5000:]}")
        return text

    def wake(self, box: int, lines: list[str], log: str, settle_s: float = 20.0,
             attempts: int = 2) -> dict[str, Any]:
        """Start ``box`` anew with ``lines`` (the page's step 4) and watch its raylet for
        ``settle_s``: Ray pre-picks the dashboard agent's ports at random, and when one is
        taken by the time the agent binds it the raylet exits at once with it
        (ray-project/ray#18053, seen once in 2 restarts of the laptop here, Ray 2.60), as a
        user who opens the lid would see it and start Ray again. So does this: at most
        ``attempts`` starts, each one's raylet tail kept in ``work``; what happened is
        returned (``wake_attempts``, ``wake_failures``). The box is put under its quota
        (:meth:`throttle`) as soon as each start returns."""
        node = self.cluster.nodes[box]
        failures: list[str] = []
        for attempt in range(attempts):
            self.sh(box, lines, f"{log}.{attempt}" if attempt else log, 240)
            with contextlib.suppress(RuntimeError):  # a box that has a quota, under it now
                self.throttle([box])
            deadline = time.monotonic() + settle_s
            while time.monotonic() < deadline and _raylet(node.work_pids()):
                time.sleep(0.5)
            if _raylet(node.work_pids()):
                return {"wake_attempts": attempt + 1, "wake_failures": failures}
            self.keep_ray_logs()
            tail = (self.work / f"{BOXES[box]}.ray_logs.txt").read_text()[-1500:]
            (self.work / f"{log}.{attempt}.raylet_died.txt").write_text(tail)
            failures.append(tail.strip().splitlines()[-1] if tail.strip() else "no log")
            node.kill_work()
        raise RuntimeError(f"{BOXES[box]}: its raylet exited right after each of {attempts} "
                           f"starts; last log lines: {failures}")

    @staticmethod
    def each(boxes: list[int], fn: Any) -> None:
        """``fn(box)`` for every box at once, as each box's owner runs its own lines (one
        thread each; the first error raised after all ended)."""
        with ThreadPoolExecutor(len(boxes)) as pool:
            for future in [pool.submit(fn, box) for box in boxes]:
                future.result()

    def start(self, timeout_s: float = 240.0) -> None:
        """Step 1 of the page on each box; the bucket serving; all three nodes alive."""
        t0 = time.monotonic()
        self.sh(0, self.page.lines(0, "desktop"), "desktop.log", timeout_s)
        deadline = time.monotonic() + 60
        while READY not in (self.work / "desktop.log").read_text():
            if time.monotonic() > deadline:
                raise RuntimeError("the bucket's server did not serve within 60 s:\n"
                                   + (self.work / "desktop.log").read_text()[-3000:])
            time.sleep(0.3)
        self.each([1, 2], lambda box: self.sh(box, self.page.lines(0, BOXES[box]),
                                              f"{BOXES[box]}.log", timeout_s))
        self.cluster.wait_for_nodes(3, timeout_s=120)
        self.throttle()
        self.timings["cluster_s"] = time.monotonic() - t0

    def plan(self, timeout_s: float = 180.0) -> str:
        block, _ = self.page.find("ray-mesh plan")
        t0 = time.monotonic()
        out = self.sh(0, self.page.lines(block, "desktop"), "plan.log", timeout_s)
        self.timings["plan_s"] = time.monotonic() - t0
        return out

    def status(self, timeout_s: float = 120.0) -> str:
        block, _ = self.page.find("ray-mesh status")
        return self.sh(0, self.page.lines(block, "desktop"), "status.log", timeout_s)

    def fallbacks(self) -> list[int]:
        """The steps of the complete fallback checkpoints in the run's bucket (asked from
        the desktop, with the bucket's key, as the run's own processes ask)."""
        run = self.page.job["run"]
        uri = f"{run['storage_path'].rstrip('/')}/{self.page.job['name']}-fallback"
        code = ("import sys; from ray_mesh.checkpointing.upload import complete; "
                'print("STEPS", *[s for s, _ in complete(sys.argv[1], sys.argv[2])])')
        out = self.sh(0, [". ~/.ray_mesh/storage.env", f"python -c '{code}' {uri} "
                          f"{run['storage_endpoint']}"], "fallbacks.log", 60)
        line = next((x for x in out.splitlines() if x.startswith("STEPS")), "STEPS")
        return sorted(int(s) for s in line.split()[1:])

    # ------------------------------------------------------------------ the job
    def job(self, overrides: dict | None = None) -> dict[str, Any]:
        """The page's job as the run gets it (see the module docstring)."""
        job = _merge(self.page.job, overrides or {})
        job["train"] = TRAIN
        job["config"] = {**job.get("config", {}), "step_log": str(self.work / "steps")}
        return json.loads(json.dumps(job).replace(EXAMPLE_HEAD, self.head_ip))

    def run_job(self, *, kill: str | None = "laptop", kill_step: int = 10,
                down_s: float = 10.0, overrides: dict | None = None,
                timeout_s: float = 400.0, fallback_step: int | None = None) -> dict[str, Any]:
        """Step 3 (and 4): the job to its end; the lid closed at ``kill_step`` (and, with
        ``fallback_step``, once the fallback checkpoint of that step is whole in the
        bucket)."""
        block, line = self.page.find("ray-mesh run")
        name = line.split()[2]  # ray-mesh run lab.yaml ...
        steps_dir = self.work / "steps"
        steps_dir.mkdir(exist_ok=True)
        steps_dir.chmod(0o777)
        (self.work / name).write_text(yaml.safe_dump(self.job(overrides)))
        cmd, env = self._command(0, self.page.lines(block, "desktop"), self.work)
        out_path = self.work / "run.out"
        extra: dict[str, Any] = {}
        t0 = time.monotonic()
        with out_path.open("w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            deadline = time.monotonic() + timeout_s
            try:
                if kill is not None:
                    extra = self._close_lid(proc, kill, kill_step, down_s, deadline,
                                            fallback_step)
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except BaseException as exc:
                _end(proc)
                raise RuntimeError(f"the lab job: {exc!r}; its console:\n"
                                   f"{out_path.read_text()[-6000:]}") from exc
        console = out_path.read_text()
        if proc.returncode != 0:
            raise RuntimeError(f"ray-mesh run failed (rc {proc.returncode}):\n{console[-6000:]}")
        return {"console": console, "wall_s": time.monotonic() - t0, **extra}

    def _close_lid(self, proc: subprocess.Popen, kill: str, kill_step: int, down_s: float,
                   deadline: float, fallback_step: int | None) -> dict[str, Any]:
        steps_dir = self.work / "steps"
        while replica_check.top_step(steps_dir) < kill_step or (
                fallback_step is not None and self.fallbacks()[-1:] < [fallback_step]):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the run ended or stalled before step {kill_step}"
                                   + (f" and its fallback of step {fallback_step}"
                                      if fallback_step is not None else ""))
            time.sleep(0.2 if fallback_step is None else 1.0)
        got = {"killed_at_step": replica_check.top_step(steps_dir), "t_kill": time.time()}
        boxes = [LAPTOP] if kill == "laptop" else [1, 2]
        for box in boxes:
            self.cluster.kill_node(box)
        if kill == "all":  # the desktop's group: its Ray Train workers (the driver stays)
            _kill_train_workers(self.cluster.head)
        time.sleep(max(0.0, got["t_kill"] + down_s - time.time()))
        got["t_back"] = time.time()
        block, _ = self.page.find("ray-mesh run")
        wake = self.page.blocks[block + 1]  # step 4: the laptop's lines
        self.each(boxes, lambda box: self.sh(
            box, [x for b, part in wake for x in part if b == "laptop"] if box == LAPTOP
            else self.page.lines(0, BOXES[box]), f"{BOXES[box]}.restart.log", 240))
        self.throttle(boxes)
        got["t_started"] = time.time()
        return got


def _kill_train_workers(node: Any) -> list[int]:
    """SIGKILL the node's Ray Train worker processes (a group's ranks), nothing else."""
    killed = []
    for pid in node.work_pids():
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"RayTrainWorker" in title:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    return killed


def _end(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)


__all__ = ["BOXES", "EXAMPLE_HEAD", "LAPTOP", "PAGE", "Lab", "Page", "check_quotas",
           "machine_cores", "read_page"]
