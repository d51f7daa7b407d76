"""Replica groups on the virtual cluster: a group lost mid-run, the others going on.

3 namespace nodes x 2 workers (``slot: 2`` per node, ``resources_per_worker={"CPU": 1,
"slot": 1}``: ``STRICT_PACK`` puts one replica group per node). One ``fit_replica_groups``
run of ``harness/replica_train.py`` (an MLP, FSDP over each group's 2 workers) per phase,
driven from the head namespace (``python -m benchmarks.replica_groups drive ARGS``, which
prints one ``RESULT {json}`` line). Per mode (``hsdp``: every step a boundary; ``diloco``:
one boundary per outer round of ``every`` inner steps):

* ``clean``: no failure, the reference for the final loss;
* ``failure``: node 2 (not the head: the coordinator lives there) is killed once the groups
  committed step ``kill_step`` (every process in its namespace: a crashed machine; its
  network stays), and ``ray start`` runs in it again ``down_s`` later. Ray Train restarts
  that group alone once the node is back; it heals from a live group over the network.

Figures of one failure run each (no spread), from the groups' logs
(``harness/replica_check.py``): the survivors' longest wait between two committed steps
from the kill on (``survivor_max_step_gap_s``), survivor steps taken twice
(``survivor_steps_lost``), the kill to the rejoined group's first committed step
(``rejoin_s``), the bytes the rejoined group received (``rejoin_bytes``), and the final
held-out loss against the clean run (``final_loss_rel_diff``). The kill time is this
process's ``time.time()`` just before the kill (one clock for every namespace).

``run_on_cluster`` also takes a ``kill`` hook in the train config (a worker that kills
itself at a step) for runs without a node kill. The user's job (the LM on the page's
cluster, a box's lid closed) is ``harness/lab_job.py``, run by ``tests/netns/test_lab_job.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO  # noqa: E402

TRAIN = str(REPO / "harness" / "replica_train.py") + ":train_loop"
STATISTIC = ("single run per mode and phase: each figure is the value of one failure run "
             "(no repeats, no spread); final_loss_rel_diff compares it to one clean run")
# Per mode: steps (boundaries), step_s (a floor on a boundary's wall time), segment
# samples per group per boundary, the step after which node 2 is killed, train config.
MODES = {
    "hsdp": {"steps": 200, "step_s": 0.4, "segment_samples": 16, "kill_step": 15,
             "train": {}},
    "diloco": {"steps": 70, "step_s": 1.2, "segment_samples": 32, "kill_step": 5,
               "train": {"diloco": {"every": 4}, "lr": 0.01}},
}
DOWN_S = 10.0


# ----------------------------------------------------------------------------- driver
def drive(args: dict) -> dict:
    """Inside the head namespace: one ``fit_replica_groups`` run; its outcome as plain data."""
    import ray

    from ray_mesh.cli.job import load_function
    from ray_mesh.raytrain.replica_groups import describe, fit_replica_groups

    ray.init(address="auto", log_to_driver=False, runtime_env={"env_vars": {
        "PYTHONPATH": str(REPO), "RAY_TRAIN_ENABLE_STATE_TRACKING": "0",
        **args.get("env", {})}})
    events: list[dict] = []

    def on_event(e: dict) -> None:
        events.append(e)
        print("EVENT", time.strftime("%H:%M:%S"), describe(e), flush=True)

    t0 = time.time()
    res = fit_replica_groups(
        load_function(TRAIN), groups=args["groups"], workers_per_group=args.get("workers"),
        total_steps=args["steps"], segment_samples=args["segment_samples"],
        config=args["config"], storage_path=args["storage"], name=args.get("name",
                                                                         "replica-groups"),
        resources_per_worker=args["resources_per_worker"], on_event=on_event,
        shares=args.get("shares", "equal"))
    status = {k: v for k, v in res.status.items() if k != "events"}
    return {"t_start": t0, "wall_s": time.time() - t0, "events": res.events,
            "groups": {str(g): r for g, r in res.groups.items()}, "status": status}


def run_on_cluster(cluster, args: dict, work: Path, *, timeout_s: float = 400,
                   kill_node: int | None = None, kill_step: int = 0,
                   down_s: float = DOWN_S) -> dict:
    """Run the driver in the head namespace of a started NetnsCluster; with ``kill_node``,
    kill that node once a group committed ``kill_step`` and start Ray in it again
    ``down_s`` later. The driver's RESULT plus ``t_kill``/``t_back`` (node kill only)."""
    work.mkdir(parents=True, exist_ok=True)
    Path(args["config"]["log_dir"]).mkdir(parents=True, exist_ok=True)  # the train fn appends
    env = cluster.node_env(cluster.head)
    env.update(RAY_ADDRESS=cluster.address, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    out_path = work / "driver.out"
    with out_path.open("w") as out:
        proc = subprocess.Popen([*cluster.head.exec_prefix(), sys.executable, "-m",
                                 "benchmarks.replica_groups", "drive", json.dumps(args)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + timeout_s
        extra: dict = {}
        try:
            if kill_node is not None:
                from harness import replica_check as rc

                log_dir = Path(args["config"]["log_dir"])
                while rc.top_step(log_dir) < kill_step:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the run ended or stalled before step {kill_step}:"
                                           f"\n{out_path.read_text()[-4000:]}")
                    time.sleep(0.2)
                extra["killed_at_step"] = rc.top_step(log_dir)
                extra["t_kill"] = time.time()
                cluster.kill_node(kill_node)
                time.sleep(max(0.0, extra["t_kill"] + down_s - time.time()))
                cluster.start_ray_node(kill_node)
                extra["t_back"] = time.time()
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException as exc:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"replica-groups driver: {exc!r}; its output:\n"
                               f"{out_path.read_text()[-6000:]}\n{_log_tails(args)}") from exc
    text = out_path.read_text()
    lines = [x for x in text.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"replica-groups driver failed (rc {proc.returncode}):\n"
                           f"{text[-4000:]}")
    return {**json.loads(lines[-1][len("RESULT "):]), **extra}


def _log_tails(args: dict) -> str:
    log_dir = Path(args["config"]["log_dir"])
    return "\n".join(f"{f.name}: " + " | ".join(f.read_text().splitlines()[-3:])
                     for f in sorted(log_dir.glob("g*"))) if log_dir.exists() else ""


# ----------------------------------------------------------------------------- figures
def summarize(log_dir: Path, killed: int | None, t_kill: float | None) -> dict:
    """The figures of one run from its logs (``killed``/``t_kill``: None for a clean run)."""
    from harness import replica_check as rc

    logs, finals = rc.read(log_dir), rc.finals(log_dir)
    twice, skipped = rc.sample_use(rc.read_used(log_dir))
    last = {g: rows[-1] for g, rows in finals.items() if rows}
    out = {"final_eval_loss": {str(g): r["eval_loss"] for g, r in last.items()},
           "final_step": {str(g): r["step"] for g, r in last.items()},
           "samples_twice": len(twice), "samples_skipped": len(skipped),
           "samples_used": sum(n for rows in logs.values() for r in rows
                               for _, n in r["ranges"]),
           "max_step_gap_all_s": max((b["t"] - a["t"] for rows in logs.values()
                                      for a, b in zip(rows, rows[1:], strict=False)),
                                     default=None),
           "loss_curve": loss_curve(logs)}
    if killed is not None:
        out.update(
            killed_group=killed,
            survivor_max_step_gap_s=rc.survivor_gaps(logs, killed, t_kill),
            survivor_steps_lost=rc.steps_lost(logs, killed),
            rejoin_s=rc.rejoin_s(logs, killed, t_kill),
            rejoin_bytes=last[killed]["rejoin_bytes_group"] if killed in last else None,
            rejoin_heal_s=last[killed].get("heal_s") if killed in last else None,
            killed_group_attempts=len({r["attempt"] for r in logs.get(killed, [])}))
    return out


def loss_curve(logs: dict[int, list[dict]]) -> dict[str, dict]:
    """Per committed step: the mean of the groups' logged training losses (each group's
    rank 0, its last inner batch) and how many groups logged it."""
    by_step: dict[int, list[float]] = {}
    for rows in logs.values():
        for r in rows:
            by_step.setdefault(r["step"], []).append(r["loss"])
    return {str(s): {"loss": sum(v) / len(v), "groups": len(v)}
            for s, v in sorted(by_step.items())}


def left_group(events: list[dict], t_kill: float) -> int | None:
    """The group that left first after the kill (the one on the killed node)."""
    after = [e for e in events if e["kind"] == "left" and e["t"] >= t_kill - 1]
    return after[0]["group"] if after else None


def driver_args(mode: str, log_dir: Path, storage: Path, *, groups: int = 3,
                workers: int = 2, steps: int | None = None, kill: dict | None = None,
                env: dict | None = None) -> dict:
    m = MODES[mode]
    config = {"log_dir": str(log_dir), "step_s": m["step_s"], **m["train"]}
    if kill:
        config["kill"] = kill
    return {"groups": groups, "workers": workers, "steps": steps or m["steps"],
            "segment_samples": m["segment_samples"], "config": config,
            "storage": str(storage), "resources_per_worker": {"CPU": 1, "slot": 1},
            "env": env or {}}


def measure(modes=("hsdp", "diloco"), down_s: float = DOWN_S, kill_node: int = 2,
            timeout_s: float = 600.0) -> dict:
    """Both modes, a clean and a node-kill run each; the figures for
    ``results.json['replica_groups']``."""
    from harness.netns import NetnsCluster, netns_unavailable_reason

    if reason := netns_unavailable_reason():
        return {"status": f"not run: {reason}"}
    out: dict = {"statistic": STATISTIC}
    t0, load0 = time.monotonic(), os.getloadavg()
    with NetnsCluster([{"slot": 2}] * 3, start_attempts=4, ray_start_timeout_s=180) as cluster:
        out["cluster_up_s"] = time.monotonic() - t0
        for mode in modes:
            try:
                out[mode] = _measure_mode(cluster, mode, down_s, kill_node, timeout_s)
            except Exception as exc:  # noqa: BLE001 - reported; the other mode still runs
                out[mode] = {"status": f"failed: {exc}"[:4000]}
    out.update(wall_s=time.monotonic() - t0, loadavg_start=load0, loadavg_end=os.getloadavg())
    return out


def _measure_mode(cluster, mode: str, down_s: float, kill_node: int, timeout_s: float) -> dict:
    m = MODES[mode]
    runs = {}
    for phase in ("clean", "failure"):
        work = cluster.root / f"{mode}_{phase}"
        args = driver_args(mode, work / "logs", cluster.root / "runs")
        kill = {"kill_node": kill_node, "kill_step": m["kill_step"],
                "down_s": down_s} if phase == "failure" else {}
        print(f"[replica_groups] {mode} {phase}", file=sys.stderr, flush=True)
        raw = run_on_cluster(cluster, args, work, timeout_s=timeout_s, **kill)
        killed = left_group(raw["events"], raw["t_kill"]) if kill else None
        runs[phase] = {**summarize(work / "logs", killed, raw.get("t_kill")),
                       "wall_s": raw["wall_s"], "events": raw["events"],
                       "groups_result": raw["groups"],
                       **{k: raw[k] for k in ("t_kill", "t_back", "killed_at_step")
                          if k in raw}}
        if kill:
            runs[phase]["t_kill_rel_s"] = raw["t_kill"] - raw["t_start"]
            runs[phase]["node_down_s"] = raw["t_back"] - raw["t_kill"]
    return _mode_figures(mode, runs, down_s, kill_node)


def _mode_figures(mode: str, runs: dict, down_s: float, kill_node: int) -> dict:
    m, clean, fail = MODES[mode], runs["clean"], runs["failure"]
    killed = fail["killed_group"]
    ref = sum(clean["final_eval_loss"].values()) / len(clean["final_eval_loss"])
    got = fail["final_eval_loss"].get(str(killed))
    survivors = [v for g, v in fail["final_eval_loss"].items() if g != str(killed)]
    got = got if got is not None else survivors[0]
    return {
        "status": "ok",
        "setup": {"nodes": 3, "groups": 3, "workers_per_group": 2, "steps": m["steps"],
                  "step_s": m["step_s"], "segment_samples": m["segment_samples"],
                  "train": m["train"], "kill_after_step": m["kill_step"],
                  "killed_at_step": fail.get("killed_at_step"),
                  "how_killed": f"NetnsCluster.kill_node({kill_node}) (every process in the "
                                f"node's namespace: SIGTERM, SIGKILL 5 s later), then "
                                f"start_ray_node({kill_node}) {down_s:g} s after the kill",
                  "tunnel": "wireguard",
                  "boundary": ("one sync step" if mode == "hsdp" else
                               f"one outer round of {m['train']['diloco']['every']} inner "
                               "steps")},
        "statistic": STATISTIC,
        "survivor_max_step_gap_s": fail["survivor_max_step_gap_s"],
        "survivor_steps_lost": fail["survivor_steps_lost"],
        "rejoin_s": fail["rejoin_s"],
        "rejoin_bytes": fail["rejoin_bytes"],
        "final_loss_rel_diff": abs(got - ref) / ref,
        "final_eval_loss_failure": got, "final_eval_loss_clean": ref,
        "clean_max_step_gap_s": clean["max_step_gap_all_s"],
        "targets": {"survivor_max_step_gap_s": "< 10", "survivor_steps_lost": "0",
                    "final_loss_rel_diff": "<= 0.03"},
        "runs": runs,
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "drive":
        res = drive(json.loads(sys.argv[2]))
        print("RESULT " + json.dumps(res, default=str), flush=True)
        sys.stdout.flush()
        os._exit(0)  # ray.shutdown() can wait on a dead node's workers
    sys.exit("usage: python -m benchmarks.replica_groups drive ARGS_JSON (started by "
             "benchmarks/run.py --only replica_groups and the netns test)")
