"""ray_mesh benchmarks, side by side in one run: ``python benchmarks/run.py [--quick]``.

Sections (``--only`` picks some):
  bringup    (a) fit()/launch -> mesh ready: plain TorchTrainer, MeshConfig, torchrun;
             4 and 8 CPU workers, median of --runs; target ray_mesh <= 1.10x plain.
  steps      (b) seconds per step of examples/hsdp.py and tp_pp_mlp.py: ray_mesh, plain
             Ray Train and torchrun alive at once, taking turns window by window
             (paired.py); target ray_mesh <= 1.03x torchrun.
  metrics    (e) a ray_mesh run, windows with ray_mesh's report bookkeeping every step vs not.
  crossnode  (c) bytes across node links per step on the netns virtual cluster, HSDP vs
             the all-reduce minimum vs flat FSDP; target HSDP <= 1.10x the minimum.
  scaling    (d) MeshConfig bring-up with 4, 8, 16 workers: time and process groups.
  meshbuild  (d) torchrun only: cost of building the mesh on an existing process group,
             needed dims only vs ray_mesh vs every dim a real group; 4, 8, 16 ranks.
  slow       (j) the slow rank/link verdict: seconds until `ray-mesh status` names a shaped
             link / a busy rank (netns cluster), and the wait sampler's cost per step
             (benchmarks/slow.py; also merged into observability).
  recovery   (f) a worker's SIGKILL to the first step after the resume, on local Ray and
             on the netns virtual cluster (root), plus that cluster's bring-up.
  wireguard  (h) the virtual tailnet's WireGuard tunnel against bare veth: HSDP step time and
             cross-node bytes per shaped rate, the planner's prediction on WireGuard, and
             checkpoint save/restore through an S3 bucket (moto) against a local directory
             (benchmarks/wireguard.py).
  rendezvous (g) a pipeline's sends across a 20 Mbit/s link with the receiver computing
             between its recvs, posted late (torch's GPipe) or early (benchmarks/rendezvous.py).
  replica_groups  fault-tolerant replica groups on the netns virtual cluster (3 nodes x 2
             workers, a group per node), HSDP and DiLoCo: a clean run and one in which a node
             is killed mid-run and comes back: the survivors' longest step gap, steps lost,
             the rejoin time and bytes, the final loss against the clean run
             (benchmarks/replica_groups.py; single runs).
  mixed_nodes  unequal boxes on the virtual cluster: 2 + 2 + 1 slots under CPU quotas, one
             replica group per node, segments equal vs sized by measured speed, against
             each box alone and leaving the odd node out (benchmarks/mixed_nodes.py;
             single runs).
  user_job   (k) the user's whole job (docs/lab_job.md) on the lab cluster: tokens/s against
             each box alone, the laptop dropped, goodput against one mesh with
             checkpoint-restart (benchmarks/user_job.py; single runs; --quick: sync, float32
             and int8, only).
  llm        (i) examples/llm.py tokens/s: ray_mesh + Ray Data vs torchrun + in-memory rows,
             runs alternating (llm.py); target ray_mesh >= 0.95x torchrun.

Prints a table and writes every figure to --out (JSON): benchmarks/results.json, or
benchmarks/results_quick.json with --quick (a smoke run never overwrites the committed
figures). Exits 1 when a requested section failed or could not run (the table and the JSON
say which). Timings are only meaningful on an otherwise idle machine; the JSON records the
load average at start and end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paired, report, settings  # noqa: E402
from benchmarks.common import REPO, median, run_torchrun  # noqa: E402

QUICK_SECTIONS = ("bringup", "steps", "metrics", "scaling", "llm", "recovery", "meshbuild",
                  "crossnode")
"""What ``--quick`` runs without ``--only``: every kind of harness path once (a local Ray's
fits, paired contenders, torchrun, Ray Data, a kill and resume, one namespace cluster with
its head driver) in under ``QUICK_BUDGET_S`` on 2 cores. Each other section starts its own
virtual cluster and times several layouts or runs (1-5 minutes each even at its smallest:
measured 2026-11-29, slowlinks 123 s, wireguard over 7 minutes); ``--quick --only NAME``
smokes it alone."""
QUICK_BUDGET_S = 600.0
SECTIONS = ("bringup", "steps", "metrics", "crossnode", "scaling", "meshbuild", "recovery",
            "slowlinks", "wireguard", "rendezvous", "diloco", "slow", "llm", "replica_groups",
            "mixed_nodes", "user_job")
RAY_SECTIONS = {"bringup", "steps", "metrics", "scaling", "recovery", "llm"}
OUT = REPO / "benchmarks" / "results.json"
QUICK_OUT = REPO / "benchmarks" / "results_quick.json"


def _free_g() -> str:
    try:
        return subprocess.run(["free", "-g"], capture_output=True, text=True,
                              timeout=10).stdout.strip("\n")
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict:
    import ray
    import torch

    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"nproc": os.cpu_count(), "mem_gib": round(mem_gib, 1),
            "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "ray": ray.__version__,
            "free_g": _free_g(), "loadavg_start": os.getloadavg()}


# ----------------------------------------------------------------------------- sections
def log(msg: str) -> None:
    """Progress on stderr (the table goes to stdout at the end)."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {msg}",
          file=sys.stderr, flush=True)


def section_bringup(cfg: dict, storage: str) -> dict:
    from benchmarks import bringup

    runs: dict[str, list[dict]] = {}
    modes = list(cfg["bringup_modes"])
    for k in range(cfg["runs"]):
        # Interleaved, so drift hits every mode alike; who goes first rotates every run.
        order = modes[k % len(modes):] + modes[:k % len(modes)]
        for n in cfg["sizes"]:
            for mode in order:
                r = bringup.measure(mode, n, storage)
                runs.setdefault(f"{mode}_{n}", []).append(r)
                log(f"bringup {mode} x{n}: ready {r['ready_s']:.1f} s")
    out: dict = {"runs": runs}
    for n in cfg["sizes"]:
        ready = {m: [r["ready_s"] for r in runs[f"{m}_{n}"]] for m in modes}
        out[f"workers_{n}"] = {
            **{f"{m}_ready_s": median(v) for m, v in ready.items()},
            "ready_s_statistic": "median over the runs",
            # run k of one mode against run k of the other (same round, minutes apart)
            "ray_mesh_vs_plain": {**paired.paired_ratios(ready["ray_mesh"], ready["plain"]),
                                  "statistic": report.PAIRED},
            "ray_mesh_vs_torchrun": {**paired.paired_ratios(ready["ray_mesh"],
                                                            ready["torchrun"]),
                                     "statistic": report.PAIRED},
        }
    return out


def _step_args(name: str, cfg: dict) -> dict:
    return {**cfg["steps_args"], "workload": name, "workers": cfg["step_workers"],
            "batch": cfg["steps_args"]["batch"] if name == "hsdp" else 32}


def section_steps(cfg: dict, storage: str) -> dict:
    """(b): every workload with the three launchers alive at once, taking turns."""
    import ray

    from benchmarks.workloads import workload_available

    address = ray.get_runtime_context().gcs_address
    out: dict = {}
    for name in cfg["step_workloads"]:
        why_not = workload_available(name)
        if why_not:
            out[name] = {"status": f"not run: {why_not}"}
            continue
        try:
            out[name] = paired.measure(name, _step_args(name, cfg), storage, address,
                                       cfg["step_contenders"])
        except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal to others
            out[name] = {"status": f"failed: {exc}"[:4000]}
            continue
        w = out[name]
        log(f"steps {name}: " + ", ".join(
            f"{c} {w[f'{c}_step_s']:.4f}" for c in cfg["step_contenders"]) +
            f"; ray_mesh/torchrun {w['ray_mesh_vs_torchrun']['median_paired']:.3f}")
    return out


def section_metrics(cfg: dict, storage: str) -> dict:
    """(e): one ray_mesh run of hsdp, windows alternating plain / report bookkeeping."""
    from benchmarks import steps

    if not steps.metrics_available():
        return {"status": "not run: ray_mesh.observability.report is not importable"}
    args = {**_step_args("hsdp", cfg), "windows": cfg["metrics_windows"], "metrics": True}
    # Which window kind comes first alternates from run to run.
    runs = [steps.measure_ray({**args, "metered_first": k % 2 == 1}, cfg["step_workers"],
                              storage) for k in range(cfg["metrics_runs"])]
    plain = [w for r in runs for w in r["step_s_windows"]]
    metered = [w for r in runs for w in r["metered_step_s_windows"]]
    return {"workload": "examples/hsdp.py", "args": args, "runs": runs,
            "plain_step_s": median(plain), "metered_step_s": median(metered),
            "overhead_us_per_step": (median(metered) - median(plain)) * 1e6,
            "metered_vs_plain": {**paired.paired_ratios(metered, plain),
                                 "statistic": report.PAIRED},
            "empty_step_us": median([r["empty_step_us"] for r in runs])}


def section_scaling(cfg: dict, storage: str, bringup_runs: dict | None) -> dict:
    from benchmarks import bringup

    out: dict = {}
    for n in cfg["scaling_sizes"]:
        runs = list((bringup_runs or {}).get(f"ray_mesh_{n}", []))
        while len(runs) < cfg["scaling_runs"]:
            runs.append(bringup.measure("ray_mesh", n, storage))
            log(f"scaling ray_mesh x{n}: ready {runs[-1]['ready_s']:.1f} s")
        out[f"workers_{n}"] = {
            "ready_s": median([r["ready_s"] for r in runs]),
            "runs": len(runs),
            "statistic": "ready_s: median over the runs",
            **{k: v for k, v in runs[0].items() if k.startswith("rank0_")},
        }
    return out


def section_meshbuild(cfg: dict) -> dict:
    out: dict = {}
    for n in cfg["meshbuild_sizes"]:
        r = run_torchrun(n, "meshbuild", {"repeats": cfg["meshbuild_repeats"]})
        log(f"meshbuild x{n} done")
        row = {}
        for variant in ("needed_dims_only", "ray_mesh", "all_dims_real"):
            v = r[variant]
            row[variant] = {**{k: x for k, x in v.items() if k != "seconds"},
                            "seconds": median(v["seconds"]), "seconds_all": v["seconds"]}
        out[f"ranks_{n}"] = row
    out["statistic"] = "seconds: median over the repeats (seconds_all: every repeat)"
    return out


def section_crossnode(cfg: dict) -> dict:
    from benchmarks import crossnode

    log("crossnode: starting the namespace cluster")
    return crossnode.measure(cfg["crossnode_model"])


def section_recovery(cfg: dict, storage: str, parts: list[str], out: dict) -> dict:
    """(f): ``local`` (this process's Ray) or ``netns`` (its own cluster, Ray shut down)."""
    from benchmarks import recovery

    work = Path(tempfile.mkdtemp(prefix="rmbench_recovery_"))
    out["statistic"] = recovery.STATISTIC
    for where in (w for w in cfg["recovery_where"] if w in parts):
        log(f"recovery {where}: fit with a SIGKILLed worker")
        try:
            part = (recovery.measure_local(work / where, storage) if where == "local"
                    else recovery.measure_netns())
        except Exception as exc:  # noqa: BLE001 - reported; the other part still runs
            part = {"status": f"failed: {exc}"[:4000]}
        out[where] = part
        out[f"{where}_s"] = part.get("recovery_s")
        if "cluster_up_s" in part:
            out[f"{where}_cluster_up_s"] = part["cluster_up_s"]
        log(f"recovery {where}: {out[f'{where}_s']}")
    return out


def section_slowlinks(cfg: dict) -> dict:
    """(g): every layout at each shaped link rate, measured beside the planner's prediction."""
    from benchmarks import slowlinks

    log("slowlinks: starting the namespace cluster")
    return slowlinks.measure(**cfg["slowlinks"])


def section_rendezvous(cfg: dict) -> dict:
    """(g): a pipeline's sends across a shaped link against its receiver's compute."""
    from benchmarks import rendezvous

    log("rendezvous: starting the namespace cluster")
    return rendezvous.measure(**cfg.get("rendezvous", {}))


def section_diloco(cfg: dict) -> dict:
    from benchmarks import diloco

    log("diloco: starting the namespace cluster")
    out = diloco.measure(**cfg["diloco"])
    if "status" not in out:
        out["plot"] = str(diloco.plot(out, REPO / "benchmarks" / "diloco_loss.png")
                          .relative_to(REPO))
    return out


def section_slow(cfg: dict) -> dict:
    """(i): the slow rank/link verdict's time and the wait sampler's cost."""
    from benchmarks import slow

    log("slow: torchrun overhead, then the namespace cluster")
    return slow.measure(**cfg["slow"])


def _keep_other_sections(results: dict, out: str, selected: list[str]) -> dict:
    """With --only, the sections not run keep their figures from the file being replaced."""
    path = Path(out)
    if not path.exists() or set(selected) == set(SECTIONS):
        return results
    kept = json.loads(path.read_text())
    runs = kept.get("partial_runs", []) + [
        {k: results[k] for k in ("command", "started", "finished", "machine") if k in results}]
    # ``results`` holds the sections run now and this run's own bookkeeping (command,
    # config, failed, table); every other section keeps its figures.
    return {**kept, **results, "partial_runs": runs}


def _section(name: str, fn, *args, **kwargs) -> dict:
    """One section; an exception becomes its status (the others still run; exit code 1).
    Its wall time is logged and kept in :data:`SECTION_S` (results' ``section_s``: ``--quick``
    must stay a smoke run, under ``QUICK_BUDGET_S`` in all)."""
    t0 = time.monotonic()
    try:
        return fn(*args, **kwargs)
    except Exception:  # noqa: BLE001 - reported in the table and the exit code
        log(f"{name} failed")
        return {"status": f"failed: {traceback.format_exc()}"[-4000:]}
    finally:
        SECTION_S[name] = round(time.monotonic() - t0, 1)
        log(f"{name}: {SECTION_S[name]:.0f} s")


SECTION_S: dict[str, float] = {}
"""Each section's wall time in this run (seconds), by name."""


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smallest settings (smoke runs)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--out", help=f"the JSON to write (default {OUT.relative_to(REPO)}, "
                                 f"with --quick {QUICK_OUT.relative_to(REPO)})")
    p.add_argument("--results-md", help="also write the table as markdown (RESULTS.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help='override a config entry, e.g. --set runs=5 or '
                        '--set \'bringup_modes=["plain","ray_mesh"]\'')
    args = p.parse_args(argv)
    args.out = args.out or str(QUICK_OUT if args.quick else OUT)
    selected = args.only or list(QUICK_SECTIONS if args.quick else SECTIONS)
    cfg = settings.config(args.quick)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in cfg:
            p.error(f"--set {key}: unknown config key; known: {', '.join(sorted(cfg))}")
        cfg[key] = json.loads(value)
    results: dict = {"command": shlex.join(["python", "benchmarks/run.py",
                                             *(argv or sys.argv[1:])]),
                     "quick": args.quick, "config": cfg, "machine": machine(),
                     "out": os.path.relpath(args.out, REPO),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    t_start = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="rmbench_")
    storage = os.path.join(tmp, "results")
    ray_started = False
    try:
        ray_sections = RAY_SECTIONS - ({"recovery"} if "local" not in cfg["recovery_where"]
                                       else set())
        if ray_sections & set(selected):
            import ray

            os.environ.setdefault("RAY_DEDUP_LOGS", "1")
            for attempt in (1, 2):  # a loaded box can miss Ray's node start-up deadline
                try:
                    ray.init(num_cpus=max(16, *cfg["scaling_sizes"]), include_dashboard=False,
                             runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
                             _temp_dir=os.path.join(tmp, f"ray{attempt}"), log_to_driver=False)
                    break
                except Exception as exc:  # noqa: BLE001
                    if attempt == 2:
                        raise
                    log(f"ray.init failed ({exc}); retrying once")
                    ray.shutdown()
            ray_started = True
            log("ray started")
        if "bringup" in selected:
            results["bringup"] = _section("bringup", section_bringup, cfg, storage)
        if "steps" in selected:
            results["steps"] = _section("steps", section_steps, cfg, storage)
        if "metrics" in selected:
            results["metrics"] = _section("metrics", section_metrics, cfg, storage)
        if "scaling" in selected:
            runs = results.get("bringup", {}).get("runs")
            results["scaling"] = _section("scaling", section_scaling, cfg, storage, runs)
        if "llm" in selected:
            from benchmarks import llm

            results["llm"] = _section("llm", llm.measure, cfg["llm"], storage)
        if "recovery" in selected:  # its netns part runs below, with this Ray shut down
            results["recovery"] = _section("recovery", section_recovery, cfg, storage,
                                           ["local"], {})
        if ray_started:
            import ray

            ray.shutdown()
            ray_started = False
        if "meshbuild" in selected:
            results["meshbuild"] = _section("meshbuild", section_meshbuild, cfg)
        if "crossnode" in selected:
            results["crossnode"] = _section("crossnode", section_crossnode, cfg)
        if "recovery" in selected and "status" not in results["recovery"]:
            section_recovery(cfg, storage, ["netns"], results["recovery"])
        if "slowlinks" in selected:
            results["slowlinks"] = _section("slowlinks", section_slowlinks, cfg)
        if "wireguard" in selected:
            from benchmarks import wireguard

            log("wireguard: veth and WireGuard clusters taking turns, then checkpoints")
            results["wireguard"] = _section("wireguard", wireguard.measure, **cfg["wireguard"])
        if "rendezvous" in selected:
            results["rendezvous"] = _section("rendezvous", section_rendezvous, cfg)
        if "diloco" in selected:
            results["diloco"] = _section("diloco", section_diloco, cfg)
        if "replica_groups" in selected:
            from benchmarks import replica_groups

            log("replica_groups: 3-node namespace cluster, clean and node-kill runs per mode")
            results["replica_groups"] = _section("replica_groups", replica_groups.measure,
                                                 **cfg.get("replica_groups", {}))
        if "mixed_nodes" in selected:
            from benchmarks import mixed_nodes

            log("mixed_nodes: 2+2+1 slots under CPU quotas, shares equal vs by speed")
            results["mixed_nodes"] = _section("mixed_nodes", mixed_nodes.measure,
                                              **cfg.get("mixed_nodes", {}))
        if "user_job" in selected:
            from benchmarks import user_job

            results["user_job"] = _section("user_job", user_job.locked_measure,
                                           user_job.merged(user_job.SETTINGS, cfg["user_job"]))
        if "slow" in selected:
            results["slow"] = _section("slow", section_slow, cfg)
            if "status" not in results["slow"]:  # the figures also live under observability
                old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
                results["observability"] = {**old.get("observability", {}),
                                            **results["slow"]}
                if results["slow"].get("detect_slow_link_s") is not None:
                    results["observability"].pop("detect_slow_link_s_note", None)
    finally:
        if ray_started:
            import ray

            ray.shutdown()
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["total_s"] = round(time.monotonic() - t_start, 1)
        results["section_s"] = dict(SECTION_S)
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        Path(args.out).write_text(json.dumps(_keep_other_sections(results, args.out, selected),
                                             indent=1, default=str))
    # The table and RESULTS.md cover every section in the file: with --only, the sections
    # not run keep their last figures (written just above; the rows would otherwise hold
    # only this run's).
    results = json.loads(Path(args.out).read_text())
    rows = report.table(results)
    report.print_table(rows)
    results["table"] = rows
    failed = report.failures(results, selected)
    results["failed"] = failed
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {args.out} ({results['total_s']:.0f} s)")
    if args.quick and not args.only and results["total_s"] > QUICK_BUDGET_S:
        print(f"\nthe smoke run took {results['total_s']:.0f} s, past its budget of "
              f"{QUICK_BUDGET_S:.0f} s (QUICK_SECTIONS in benchmarks/run.py): a section grew, "
              f"or the machine was busy (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    if args.results_md:
        report.write_markdown(args.results_md, results, rows)  # keeps the hand-written notes
        print(f"wrote {args.results_md}")
    if failed:
        print("\nFAILED sections (exit code 1):\n  " + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
