"""The user's whole job (issue 43, item 5): ``results.json["user_job"]``.

The job of ``docs/lab_job.md`` (the LM's small preset as replica groups, ``shares: speed``,
its data read on each box from its own disk, checkpoints in a moto bucket on the head's
tailnet address) on the page's virtual cluster (``harness/lab_job.py``'s :class:`Lab`:
three namespace boxes over real WireGuard with private filesystems, 2 + 2 + 1 CPU workers,
the laptop the one whose lid closes), all in one run. Every box's Ray processes run under
a CPU quota of their own (``box_quotas_cores``: cores per box, the tower the slower box at
0.2 a worker, the others at 0.4), set by the Lab once Ray is up on a box and again when a
box is started anew, in every run below alike. The quotas sum to less than the machine's
cores (refused otherwise, before anything starts), leaving room for what runs outside
them: the driver, the head's GCS and bucket, wireguard-go, and the actors a run starts on
the head for every group (Ray Train's controllers and their helpers, the groups'
coordinator: ``harness.lab_job.HEAD_SERVICES``, moved out as Ray starts them, in the whole
job and each box alone alike; inside, they took ~0.18 of the desktop's 0.8 cores with three
groups). A quota is a cap: a box does at
most its share of work, in the whole job or alone, so a box alone cannot borrow the idle
boxes' share of the machine's two cores.

1. **throughput_of_sum**, per mode (``sync``: the page's job; ``sync_int8``: the same with
   ``replica_groups.compress: int8``, each step's gradients crossing the tunnel as int8;
   ``diloco``: the same with ``config.diloco.every`` inner steps per round; a mode named
   ``diloco_<x>`` or ``sync_<x>`` is the same kind with settings of its own, a DiLoCo
   mode's ``compress`` its pseudo-gradients' ``config.diloco.compress``): the whole
   job's tokens/s against the sum
   of each box alone (one group pinned to that box, at the batch it trains in the whole
   job). With every box capped, the three alone runs go one after another (box 0, 1, 2),
   each stopped once it committed ``alone_counted`` steps after its warm-up. (Side by
   side, the way ``benchmarks/mixed_nodes.py`` keeps a box alone from borrowing, three
   bring-ups and runs at once took 7 minutes at a 1-minute load of 68 on two cores: all
   three cut, the figure refused by the load rule.) What a quota does not hold (the
   uncapped processes, caches, memory) a box alone may still gain a little of, so the sum
   leans high and the figure low. tokens/s: committed steps' tokens over their commit
   times after the first ``warmup`` steps, the whole job's and each box alone's over its
   own steps. With ``whole_twice`` the whole job runs again after the boxes alone and the
   ratio takes the mean of its two runs: the machine's speed drifts over the minutes
   between them (10-17% between two runs back to back, 2026-12-01), and a steady drift
   cancels around the alone runs.
2. **the laptop dropped** (the same job, sync unless ``drops.mode`` names another of the
   modes run in part 1, whose uninterrupted run is then the loss reference; the laptop's
   every process killed ``first_s`` after the run's first committed step and then every
   ``every_s``, Ray started on it again ``down_s`` later with the page's step 4):
   ``survivor_max_step_gap_s`` (the longest wait between two steps of the other groups
   around any drop: committed steps with sync, optimizer steps under DiLoCo, whose commit is
   once a round, ``harness/lab_train.py``), ``survivor_steps_lost``,
   ``rejoin_s`` (the first drop to the laptop group's first step of its next attempt),
   samples used twice / skipped, ``final_loss_rel_diff`` (its held-out loss against the
   uninterrupted sync run of 1, the same job);
3. **goodput_vs_restart**: useful tokens per hour of run 2 against the same job as one mesh
   (``examples/llm.py:train_loop`` through ``benchmarks/_user_job_mesh.py``, FSDP over one
   worker per box, as ray_mesh's refusal of one mesh over 2 + 2 + 1 workers advises; a
   checkpoint every ``checkpoint_every`` steps into the bucket, Ray Train's ``max_failures``)
   under the same drops; "useful" is defined in ``benchmarks/user_job_figures.py``. Both
   over one training window (``goodput_window``: the same seconds from each shape's first
   step, so the same drops at the same offsets; the bring-up of a run of hours is paid
   once, not per hour); ``goodput_vs_restart_from_launch`` counts from the launch, as the
   figures before 2026-12-01 did, with each shape's ``startup_s``. The one mesh is cut at
   ``cut_s`` if it has not finished; its goodput from the launch is then an upper bound
   and that ratio a lower bound. The mesh uses 3 of the 5 CPU workers, so the ratio holds
   the layout's gain too: ``goodput_model`` shows the failure-free rates beside it.

Drops every ``every_s`` (90 s here, the first 15 s into training) stand in for "a node
drops every few minutes": the runs are 2-5 minutes long. Shorter is no test of recovery: at
45 s neither the laptop's group (44-50 s from a drop to its next step at 90 s) nor the one
mesh (which waits for all three boxes) took a step between two drops (2026-11-28 and
2026-11-30), and the ratio compared two runs that never healed. The whole benchmark (three
modes, the drops, the one mesh) took 28 minutes on a quiet 2-core machine (1,683 s, 2026-11-28,
drops every 90 s; before ``whole_twice``, which adds a whole job per mode, 3-5 minutes);
``--quick`` (two sync modes, one whole job each) 9 minutes. What scales: the one mesh loses, per
drop, the restart (the box's absence, Ray Train's new worker group, the bring-up) plus on
average half a checkpoint interval of steps; the groups lose the laptop's share while it
is away and the survivors' pause. Both losses are per drop, so goodput at
an interval T is about (1 - loss_per_drop / T) of the failure-free rate: ``goodput_model``
gives that from the measured parts for longer intervals (a model, not a measurement).

Every run records the quotas it ran under (``box_quotas_cores``), the cores each box's
cgroup and the tailnet's used over the steps its tokens/s counts (``box_cores``: a box
below its quota in the whole job waited, for the others or the exchange; at it, it
computed), and its load (``user_job_figures.LoadSampler``); a figure whose runs ran
while other processes loaded the machine above 2 is kept in ``recorded`` and published as
None (``invalid`` says why). Statistic: single runs, no repeats.

    python -m benchmarks.user_job [--quick] [--out FILE] [--results-md FILE]

takes the machine-wide heavy-test lock (``tests/helpers/heavy.py``) for its whole run,
writes ``results.json["user_job"]`` and replaces the user-job section of RESULTS.md.
"""

from __future__ import annotations

import copy
import json
import re
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import user_job_figures as uf  # noqa: E402
from benchmarks import user_job_runs as ur  # noqa: E402
from benchmarks.common import REPO  # noqa: E402

SETTINGS: dict[str, Any] = {
    "modes": ["sync", "sync_int8", "diloco"], "warmup": 5,
    # every box's Ray processes, in every run: cores (their sum below the machine's)
    "box_quotas_cores": {"desktop": 0.8, "tower": 0.4, "laptop": 0.4},
    # alone_counted: steps each box alone commits after its warm-up (then stopped)
    "sync": {"steps": 40, "alone_counted": 12},
    # the same job with replica_groups.compress: int8 (gradients between groups as int8)
    "sync_int8": {"steps": 40, "alone_counted": 12, "compress": "int8"},
    # the page's DiLoCo setting (docs/lab_job.md): every 16 inner steps, int8, 128 samples
    # a group per round (so a round's compute outweighs its exchange through the tunnel)
    "diloco": {"every": 16, "rounds": 10, "segment_samples": 128, "alone_counted": 3,
               "compress": "int8"},
    # from the run's first committed step; both shapes get the same schedule
    # mode: the groups' mode under drops (its uninterrupted run is the loss reference)
    # every 90 s: at 45 s neither the laptop's group nor the one mesh came back between two
    # drops (2026-11-28 and 2026-11-30), and both sides measured runs that never healed
    "drops": {"first_s": 15.0, "every_s": 90.0, "down_s": 10.0, "mode": "sync"},
    # batch_size None: a step of the page's job, each box's segment_samples (the same samples
    # a step as the groups take, whatever the page sets)
    "mesh": {"checkpoint_every": 5, "batch_size": None, "max_failures": 50, "cut_s": 180.0},
    "goodput": True, "timeout_s": 420.0, "quiet_wait_s": 120.0, "lock_wait_s": 3600.0,
    # the whole job again after the boxes alone, the ratio over the mean of the two: this
    # machine's speed drifted 10-17% in the minutes between a run's whole job and its boxes
    # alone (2026-12-01: a ratio of 1.08, one of 0.82, in two runs back to back), and the
    # mean of two whole runs around the alone runs cancels a steady drift
    "whole_twice": True,
}


# ----------------------------------------------------------------------------- figures
def read_groups(run: dict, seq_len: int, warmup: int) -> dict:
    from harness import replica_check as rc

    logs, finals = rc.read(run["steps_dir"]), rc.finals(run["steps_dir"])
    tps, counted = uf.tokens_per_s(logs, seq_len, warmup)
    losses = {g: rows[-1].get("eval_loss") for g, rows in finals.items() if rows}
    losses = {g: v for g, v in losses.items() if v is not None}
    # the driver's line "replica groups: group 0: dp_shard=2 on 100.x.y.1; group 1: ..."
    line = re.search(r"replica groups: (.*)", Path(run["console"]).read_text())
    layouts = {int(g): {"layout": lay, "node": node} for g, lay, node in re.findall(
        r"group (\d+): (\S+?)(?: on ([\d.]+))?(?:;|$)", line.group(1) if line else "")}
    return {**run, "tokens_per_s": tps, "steps_counted": counted,
            "eval_loss": sum(losses.values()) / len(losses) if losses else None,
            "eval_losses": losses, "shares": uf.mean_shares(logs, warmup),
            "layouts": layouts, "last_t": max(r["t"] for rows in logs.values() for r in rows),
            "useful_tokens": uf.groups_useful_tokens(logs, seq_len)}


def group_on(run: dict, ip: str) -> int:
    """The group of ``run`` that ran on the node at ``ip`` (the driver's groups line)."""
    for gid, lay in run["layouts"].items():
        if lay["node"] == ip:
            return gid
    raise RuntimeError(f"no group on {ip} in the run's groups line: {run['layouts']}; "
                       f"its console: {run['console']}")


def throughput(lab, cfg: dict, mode: str, seq_len: int) -> dict:
    """Run 1 of the module docstring for one mode."""
    from harness import replica_check as rc
    from harness.lab_job import BOXES

    w = cfg["warmup"]

    def whole_job(tag: str, what: str) -> dict:
        ur.log(f"{mode}: {what}")
        ran = ur.run_all(lab, {tag: ur.groups_job(lab, tag, cfg, mode)}, cfg["timeout_s"],
                         warmup=w)
        return read_groups(ran[tag], seq_len, w)

    tag = f"{mode}-whole"
    whole = whole_job(tag, "the whole job")
    alone = {}
    for i, dp in enumerate(ur.BOX_DP):  # one after another, each under its box's quota
        ip, t = lab.cluster.nodes[i].ip, f"{mode}-alone{i}"
        seg = uf.alone_batch(whole["shares"][group_on(whole, ip)], dp)
        # DiLoCo: the inner steps of the whole job's batch (uf.alone_every), not larger
        every = (uf.alone_every(seg, dp, cfg[mode]["every"], cfg[mode]["segment_samples"])
                 if mode.startswith("diloco") else None)
        job = ur.groups_job(lab, t, cfg, mode, [{"mesh": {"dp_shard": dp}, "node": ip}],
                            seg, steps_factor=100, every=every)  # stopped when counted
        ur.log(f"{mode}: box {i} ({BOXES[i]}) alone")
        ran = ur.run_all(lab, {t: job}, cfg["timeout_s"],
                         stop_when=ur.counted(cfg[mode]["alone_counted"], w), warmup=w)
        alone[t] = {**ran[t], "segment_samples": seg,
                    **({"every": every} if every is not None else {})}
    wholes = {tag: whole}
    if cfg.get("whole_twice"):
        wholes[f"{mode}-whole-after"] = whole_job(f"{mode}-whole-after", "the whole job again")
    ratio, rates = uf.throughput_of_sum(
        sum(r["tokens_per_s"] for r in wholes.values()) / len(wholes),
        {t: rc.read(r["steps_dir"]) for t, r in alone.items()}, seq_len, w)
    for t, r in alone.items():
        r.update(rates[t])
    return {"runs": {**wholes, **alone},
            "figures": {f"throughput_of_sum_{mode}": ratio},
            "sides": {f"throughput_of_sum_{mode}": [*wholes, *alone]}}


def dropped(lab, cfg: dict, seq_len: int, clean: dict) -> dict:
    """Runs 2 and 3 of the module docstring: both shapes under the same drops."""
    from harness import replica_check as rc
    from harness.lab_job import LAPTOP

    drops = cfg["drops"]
    mode = drops.get("mode", "sync")  # the groups' mode (its uninterrupted run: ``clean``)
    ur.log(f"replica groups ({mode}), the laptop dropped at {drops['first_s']:g} s and every "
           f"{drops['every_s']:g} s, {drops['down_s']:g} s down")
    ran = ur.run_all(lab, {"groups-drops": ur.groups_job(lab, "groups-drops", cfg, mode)},
                     cfg["timeout_s"], drops)
    g = read_groups(ran["groups-drops"], seq_len, cfg["warmup"])
    logs, events = rc.read(g["steps_dir"]), g["drops"]
    if not events:
        raise RuntimeError("the replica-group run ended before the first drop: raise "
                           "sync.steps or lower drops.first_s")
    killed = group_on(g, lab.cluster.nodes[LAPTOP].ip)
    twice, skipped = rc.sample_use(rc.read_used(g["steps_dir"]))
    # DiLoCo commits once a round (``every`` inner steps): its survivors' pause is read from
    # their optimizer steps; sync takes its one step inside the commit
    gaps = rc.read_inner(g["steps_dir"]) if mode == "diloco" else logs
    figures = {
        "survivor_max_step_gap_s": max(rc.survivor_gaps(gaps, killed, e["t_kill"])
                                       for e in events),
        "survivor_steps_lost": rc.steps_lost(logs, killed),
        "rejoin_s": uf.rejoin_after(logs, killed, events[0]["t_kill"]),
        "final_loss_rel_diff": abs(g["eval_loss"] - clean["eval_loss"]) / clean["eval_loss"],
    }
    g.update(killed_group=killed, restarted_group=uf.killed_group(logs, events[0]["t_kill"]),
             samples_twice=len(twice), samples_skipped=len(skipped),
             rejoins_s=[uf.rejoin_after(logs, killed, e["t_kill"]) for e in events])
    g["survivor_gap_read_from"] = "inner steps" if mode == "diloco" else "committed steps"
    out = {"runs": {"groups-drops": g}, "figures": figures,
           "sides": {k: ["groups-drops"] for k in figures}}
    out["sides"]["final_loss_rel_diff"].append(f"{mode}-whole")
    if not cfg["goodput"]:
        return out
    ur.log("one mesh with checkpoint-restart, the same drops")
    m = ur.run_all(lab, {"mesh-drops": ur.mesh_job(lab, "mesh-drops", cfg)},
                   cfg["timeout_s"], drops, cut_s=cfg["mesh"]["cut_s"])["mesh-drops"]
    path = Path(m["steps_dir"]) / "mesh.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    if not any("step" in r for r in rows):
        raise RuntimeError(f"the one mesh took no step:\n{Path(m['console']).read_text()[-4000:]}")
    lineage = uf.mesh_lineage(rows)
    per_step = ur.mesh_batch(lab, cfg) * seq_len
    m.update(lineage, useful_tokens=lineage["final_step"] * per_step,
             last_t=max(r["t"] for r in rows if "step" in r),
             resumes_s=uf.mesh_resumes(rows, [e["t_kill"] for e in m["drops"]]))
    # from the launch (bring-up included): kept beside the training window's figure
    g["goodput_tokens_per_h"] = uf.goodput_per_hour(g["useful_tokens"], g["t_launch"],
                                                    g["last_t"])
    m["goodput_tokens_per_h"] = uf.goodput_per_hour(m["useful_tokens"], m["t_launch"],
                                                    m["last_t"] if not m["cut"]
                                                    else m["t_launch"] + cfg["mesh"]["cut_s"])
    window = uf.same_window(logs, seq_len, rows, per_step,
                            ([e["t_kill"] for e in events], [e["t_kill"] for e in m["drops"]]))
    g_first, m_first = window.pop("first_step_t")
    g["startup_s"], m["startup_s"] = g_first - g["t_launch"], m_first - m["t_launch"]
    figures["goodput_vs_restart"] = window["ratio"]
    figures["goodput_vs_restart_from_launch"] = (g["goodput_tokens_per_h"]
                                                 / m["goodput_tokens_per_h"])
    out["goodput_window"] = window
    out["runs"]["mesh-drops"] = m
    for name in ("goodput_vs_restart", "goodput_vs_restart_from_launch"):
        out["sides"][name] = ["groups-drops", "mesh-drops"]
    if m["cut"]:
        out["goodput_vs_restart_from_launch_is_lower_bound"] = True
    # the model for longer intervals (module docstring): rates and losses per drop
    step_s, share = uf.mesh_step_s(rows), clean["shares"].get(killed, 0.0)
    resumes = sorted(r for r in m["resumes_s"] if r is not None)
    if step_s and figures["rejoin_s"] is not None and resumes:
        frac = share / max(1e-9, sum(clean["shares"].values()))
        out["goodput_model"] = {
            "loss_per_drop_groups_s": frac * figures["rejoin_s"]
            + figures["survivor_max_step_gap_s"],
            "loss_per_drop_mesh_s": resumes[len(resumes) // 2]
            + cfg["mesh"]["checkpoint_every"] / 2 * step_s,
            "tokens_per_s_groups": clean["tokens_per_s"], "tokens_per_s_mesh": per_step / step_s}
        gm = out["goodput_model"]
        gm["ratio"] = uf.goodput_model(gm["tokens_per_s_groups"], gm["loss_per_drop_groups_s"],
                                       gm["tokens_per_s_mesh"], gm["loss_per_drop_mesh_s"])
    return out


def measure(settings: dict | None = None) -> dict:
    """Every run of the module docstring, in one virtual cluster: ``results.json``'s
    ``user_job`` (see :func:`locked_measure`)."""
    from harness.lab_job import Lab
    from harness.netns import netns_unavailable_reason
    from harness.netns.cpu import cpu_quota_unavailable_reason

    cfg = copy.deepcopy(settings or SETTINGS)
    if reason := netns_unavailable_reason() or cpu_quota_unavailable_reason():
        return {"status": f"not run: {reason}"}
    start_load = uf.wait_quiet(cfg["quiet_wait_s"], say=ur.log)
    out: dict[str, Any] = {"settings": cfg, "loadavg_1m_at_start": start_load,
                           "statistic": "single run of each configuration (no repeats, no "
                                        "spread); tokens/s over the committed steps after "
                                        f"the first {cfg['warmup']}",
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="rmbench_user_job_"))
    runs: dict[str, dict] = {}
    figures: dict[str, Any] = {}
    sides: dict[str, list[str]] = {}
    failed: dict[str, str] = {}
    with Lab(work, quotas=cfg.get("box_quotas_cores")) as lab:
        lab.start()
        out["cluster_s"] = lab.timings.get("cluster_s")
        out["box_quotas_cores"] = lab.box_quotas
        seq_len = int(lab.page.job["data"]["seq_len"])
        parts = [(mode, lambda m=mode: throughput(lab, cfg, m, seq_len))
                 for mode in cfg["modes"]]
        drop_mode = (cfg.get("drops") or {}).get("mode", "sync")
        if drop_mode in cfg["modes"] and cfg.get("drops"):
            parts.append(("drops", lambda: dropped(lab, cfg, seq_len,
                                                   runs[f"{drop_mode}-whole"])))
        for name, fn in parts:  # a part that fails leaves the others' figures
            try:
                part = fn()
            except Exception:  # noqa: BLE001 - in the status, the exit code and the report
                failed[name] = traceback.format_exc()[-3000:]
                ur.log(f"{name} failed:\n{failed[name]}")
                continue
            runs.update(part["runs"])
            figures.update(part["figures"])
            sides.update(part["sides"])
            out.update({k: v for k, v in part.items() if k.startswith("goodput_")})
    out.update(uf.publish(figures, sides, runs, start_load))
    out.update(runs=runs, sides=sides, wall_s=time.monotonic() - t0, work=str(work),
               failed=failed, status="ok" if not failed else
               "failed: " + "; ".join(f"{k}: {v.splitlines()[-1]}" for k, v in failed.items()))
    return out


def merged(*layers: dict) -> dict:
    """``SETTINGS``-like dicts merged left to right, nested dicts key by key."""
    out: dict = {}
    for layer in layers:
        for k, v in layer.items():
            out[k] = merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k),
                                                                             dict) else v
    return out


def locked_measure(settings: dict) -> dict:
    """:func:`measure` holding the machine-wide heavy-test lock (tests/helpers/heavy.py),
    or, when another holds it past ``lock_wait_s``, a ``not run`` status. Quotas that name
    no box or sum to the machine's cores or more are refused first (``ValueError``)."""
    from harness.lab_job import check_quotas, machine_cores

    if settings.get("box_quotas_cores") is not None:
        check_quotas(settings["box_quotas_cores"], machine_cores())
    try:
        with ur.heavy_lock(settings.get("lock_wait_s", 3600.0)):
            return measure(settings)
    except TimeoutError as exc:
        return {"status": f"not run: {exc}"}


def main(argv: list[str] | None = None) -> int:
    import argparse

    from benchmarks import settings, user_job_md

    p = argparse.ArgumentParser(description="the user's whole job: results.json['user_job']")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run (sync, float32 and int8, 20 steps)")
    p.add_argument("--out", help="default benchmarks/results.json (--quick: "
                                 "results_quick.json, the committed figures stay)")
    p.add_argument("--results-md", help="default benchmarks/RESULTS.md (--quick: none)")
    p.add_argument("--set", default="{}", help="JSON merged over the settings")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cluster is taken down
    bench = REPO / "benchmarks"
    args.out = args.out or str(bench / ("results_quick.json" if args.quick else "results.json"))
    if not args.quick:
        args.results_md = args.results_md or str(bench / "RESULTS.md")
    cfg = merged(SETTINGS, settings.config(args.quick)["user_job"], json.loads(args.set))
    result = locked_measure(cfg)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.exists() else {}
    results["user_job"] = result
    out.write_text(json.dumps(results, indent=1, default=str))
    print(user_job_md.summary(result))
    print(f"wrote {out} ['user_job']")
    if args.results_md:
        user_job_md.write_section(args.results_md, result)
        print(f"wrote the user-job section of {args.results_md}")
    return 0 if result.get("status") == "ok" else 1


if __name__ == "__main__":
    raise SystemExit(main())
