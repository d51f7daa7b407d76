"""ray_mesh benchmarks, side by side in one run: ``python benchmarks/run.py [--quick]``.

Sections (``--only`` picks some):
  bringup    (a) fit()/launch -> mesh ready: plain TorchTrainer, MeshConfig, torchrun;
             4 and 8 CPU workers, median of --runs; target ray_mesh <= 1.10x plain.
  steps      (b) seconds per step of examples/hsdp.py and tp_pp_mlp.py: ray_mesh, plain
             Ray Train and torchrun alive at once, taking turns window by window
             (paired.py); target ray_mesh <= 1.03x torchrun.
  metrics    (e) a ray_mesh run, windows inside ray_mesh.observability.metrics.StepMeter vs not.
  crossnode  (c) bytes across node links per step on the netns virtual cluster, HSDP vs
             the all-reduce minimum vs flat FSDP; target HSDP <= 1.10x the minimum.
  scaling    (d) MeshConfig bring-up with 4, 8, 16 workers: time and process groups.
  meshbuild  (d) torchrun only: cost of building the mesh on an existing process group,
             needed dims only vs ray_mesh vs every dim a real group; 4, 8, 16 ranks.

Prints a table and writes every figure to --out (JSON). Timings are only meaningful on an
otherwise idle machine; the JSON records the load average at start and end.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import paired  # noqa: E402
from benchmarks.common import REPO, median, ratio, run_torchrun  # noqa: E402

SECTIONS = ("bringup", "steps", "metrics", "crossnode", "scaling", "meshbuild", "slowlinks",
            "diloco")
RAY_SECTIONS = {"bringup", "steps", "metrics", "scaling"}


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
    for _ in range(cfg["runs"]):
        for n in cfg["sizes"]:  # interleaved, so drift hits every mode alike
            for mode in cfg["bringup_modes"]:
                r = bringup.measure(mode, n, storage)
                runs.setdefault(f"{mode}_{n}", []).append(r)
                log(f"bringup {mode} x{n}: ready {r['ready_s']:.1f} s")
    out: dict = {"runs": runs}
    for n in cfg["sizes"]:
        med = {m: median([r["ready_s"] for r in runs[f"{m}_{n}"]]) for m in cfg["bringup_modes"]}
        out[f"workers_{n}"] = {
            **{f"{m}_ready_s": v for m, v in med.items()},
            "ray_mesh_vs_plain": ratio(med["ray_mesh"], med["plain"]),
            "ray_mesh_vs_torchrun": ratio(med["ray_mesh"], med["torchrun"]),
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
    """(e): one ray_mesh run of hsdp, windows alternating plain / inside StepMeter."""
    from benchmarks import steps

    if not steps.metrics_available():
        return {"status": "not run: ray_mesh.observability.metrics is not importable"}
    args = {**_step_args("hsdp", cfg), "windows": cfg["metrics_windows"], "metrics": True}
    runs = [steps.measure_ray(args, cfg["step_workers"], storage)
            for _ in range(cfg["metrics_runs"])]
    plain = [w for r in runs for w in r["step_s_windows"]]
    metered = [w for r in runs for w in r["metered_step_s_windows"]]
    paired_ratios = [m / p for r in runs for p, m in
                     zip(r["step_s_windows"], r["metered_step_s_windows"], strict=True)]
    return {"workload": "examples/hsdp.py", "args": args, "runs": runs,
            "plain_step_s": median(plain), "metered_step_s": median(metered),
            "overhead_us_per_step": (median(metered) - median(plain)) * 1e6,
            "metered_vs_plain": median(paired_ratios),
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
    return out


def section_crossnode(cfg: dict) -> dict:
    from benchmarks import crossnode

    log("crossnode: starting the namespace cluster")
    try:
        return crossnode.measure(cfg["crossnode_model"])
    except Exception as exc:  # noqa: BLE001 - reported in the table, not fatal to others
        return {"status": f"failed: {exc}"[:4000]}


def section_slowlinks(cfg: dict) -> dict:
    from benchmarks import slowlinks

    log("slowlinks: starting the namespace cluster")
    return slowlinks.measure(**cfg["slowlinks"])


# ----------------------------------------------------------------------------- table
def section_diloco(cfg: dict) -> dict:
    from benchmarks import diloco

    log("diloco: starting the namespace cluster")
    out = diloco.measure(**cfg["diloco"])
    if "status" not in out:
        out["plot"] = str(diloco.plot(out, REPO / "benchmarks" / "diloco_loss.png")
                          .relative_to(REPO))
    return out


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def table(results: dict) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []

    def add(section, what, value, target=""):
        rows.append((section, what, _fmt(value), target))

    b = results.get("bringup")
    if b:
        for key, row in b.items():
            if key.startswith("workers_"):
                n = key.split("_")[1]
                for m in ("plain", "ray_mesh", "torchrun", "ray_mesh_nopf"):
                    if f"{m}_ready_s" in row:
                        add("a bring-up", f"{n} workers {m} ready s (median)",
                            row[f"{m}_ready_s"])
                add("a bring-up", f"{n} workers ray_mesh / plain", row["ray_mesh_vs_plain"],
                    "<= 1.10")
    for name, w in (results.get("steps") or {}).items():
        if "status" in w:
            add("b steps", f"{name} status", w["status"])
            continue
        for c in paired.KNOWN_CONTENDERS:
            if f"{c}_step_s" in w:
                add("b steps", f"{name}: {c} s/step (median)", w[f"{c}_step_s"])
        for a, b in paired.RATIO_PAIRS:
            r = w.get(f"{a}_vs_{b}")
            if r:
                add("b steps", f"{name}: {a} / {b} wall, paired median [q1, q3]",
                    f"{r['median_paired']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]",
                    "<= 1.03" if (a, b) == ("ray_mesh", "torchrun") else "")
        r = w.get("ray_mesh_vs_torchrun_cpu")
        if r:
            add("b steps", f"{name}: ray_mesh / torchrun CPU s, paired median [q1, q3]",
                f"{r['median_paired']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}]")
    m = results.get("metrics")
    if m:
        if "status" in m:
            add("e metrics", "status", m["status"])
        else:
            add("e metrics", "hsdp: StepMeter overhead us/step", m["overhead_us_per_step"])
            add("e metrics", "hsdp: metered / plain (paired median)", m["metered_vs_plain"])
            add("e metrics", "StepMeter cost around an empty step, us", m["empty_step_us"])
    c = results.get("crossnode")
    if c:
        if c.get("status") == "ok":
            add("c cross-node", "params", c["params"])
            add("c cross-node", "minimum B/step (8 x params)", c["minimum_bytes_per_step"])
            add("c cross-node", "HSDP wire B/step", c["hsdp"]["wire_bytes_per_step"])
            add("c cross-node", "HSDP / minimum (wire)", c["hsdp_vs_min_wire"], "<= 1.10")
            add("c cross-node", "HSDP / minimum (headers off)", c["hsdp_vs_min_payload"])
            add("c cross-node", "flat FSDP wire B/step", c["fsdp"]["wire_bytes_per_step"])
            add("c cross-node", "flat FSDP / HSDP (wire)", c["fsdp_vs_hsdp_wire"])
        else:
            add("c cross-node", "status", c.get("status"))
    sc = results.get("scaling")
    if sc:
        for key, row in sc.items():
            n = key.split("_")[1]
            add("d scaling", f"{n} workers MeshConfig ready s", row["ready_s"])
            add("d scaling", f"{n} workers new_group calls / groups held (rank 0)",
                f"{row.get('rank0_new_group_calls')} / {row.get('rank0_real_groups_held')}"
                f" real + {row.get('rank0_fake_groups_held')} fake")
    mb = results.get("meshbuild")
    if mb:
        for key, row in mb.items():
            n = key.split("_")[1]
            for variant, v in row.items():
                add("d mesh build", f"{n} ranks {variant}: s / new_group / real groups",
                    f"{v['seconds']:.3f} / {v['new_group_calls']} / {v['real_groups_held']}")
    for rate, sec in (results.get("slowlinks") or {}).items():
        if not isinstance(sec, dict) or "pick" not in sec:
            continue
        errs = [abs(v["step_error"]) for v in sec.values()
                if isinstance(v, dict) and "step_error" in v]
        add("g slow links", f"{rate}: pick / fastest (measured step, median)",
            f"{sec['pick']} / {sec['fastest']} = {sec['pick_vs_fastest']:.2f}", "<= 1.05")
        add("g slow links", f"{rate}: worst |predicted/measured - 1| over layouts",
            max(errs), "<= 0.15")
        if "hsdp" in sec and "hsdp+bf16" in sec:
            add("g slow links", f"{rate}: hsdp bf16 / fp32 cross-node bytes",
                sec["hsdp+bf16"]["cross_node_bytes_per_step"]
                / sec["hsdp"]["cross_node_bytes_per_step"], "0.5 +- 10%")
    for rate, sec in (results.get("diloco") or {}).items():
        if not isinstance(sec, dict) or "diloco_tokens_s" not in sec:
            continue
        tag = f"{rate}, H={sec['every']} {sec['compress']}"
        add("h diloco", f"{tag}: tokens/s diloco / sync / unshaped sync",
            f"{sec['diloco_tokens_s']:.0f} / {sec['sync_tokens_s']:.0f} / "
            f"{sec['unshaped_tokens_s']:.0f}")
        add("h diloco", f"{tag}: cross-node bytes/step diloco / sync",
            f"{sec['diloco_cross_node_bytes_per_step']:.3g} / "
            f"{sec['sync_cross_node_bytes_per_step']:.3g}")
        add("h diloco", f"{tag}: val loss diloco / sync (same tokens)",
            f"{sec['diloco_val_loss']:.3f} / {sec['sync_val_loss']:.3f}")
    return rows


NOTES = """\
## How each figure is measured

- **a bring-up**: driver clock just before `TorchTrainer.fit()` (or the `torchrun` launch) to
  the latest rank's clock once its mesh exists; HSDP mesh dp_replicate=2 x dp_shard=N/2 on N
  CPU workers (gloo), one Ray logical CPU each; median over the runs, modes interleaved.
  `plain` = Ray's `TorchConfig` + `init_device_mesh` of the two needed dims in the train
  function; `ray_mesh` = `MeshConfig` defaults (probe, plan, pre-flight, all named dims);
  `ray_mesh_nopf` = `MeshConfig(preflight=False)`.
- **b steps**: seconds per training step of the example's own `build`/`train_step` (same
  model, mesh and data), 4 ranks each, three launchers alive at once (`benchmarks/paired.py`):
  `torchrun` + `ray_mesh.init_mesh`; `ray_plain` = `TorchTrainer` with Ray's `TorchConfig`
  and `ray_mesh.init_mesh` in the train function; `ray_mesh` = `MeshConfig`. After a warm-up
  they take turns (`benchmarks/baton.py`): per round one window of steps each, between
  barriers, order rotating every round, the others idle in a barrier. Ratios are medians
  of the per-round ratios (window k of one launcher over window k of the other), with
  quartiles; CPU s/step sums `time.process_time()` over the 4 ranks (every thread of each
  process, the launcher's included).
- **e metrics**: one `MeshConfig` run per repeat, windows alternate plain / inside
  `StepMeter.step()` (observability.metrics; paired median of metered/plain); plus the cost of
  `with meter.step()` around an empty step (20 000 iterations, flushes included).
- **c cross-node**: namespace cluster (2 nodes x 2 workers, veth + bridge, `tailscale0`);
  each node's local rank 0 reads its own `/sys/class/net/tailscale0/statistics` around the
  steps; cross-node bytes = sum of the nodes' tx deltas, minus an idle window of the same
  length. Model: an MLP of `layers` x Linear(width, width), FSDP2 per layer + root.
  Minimum for HSDP = 2 (R-1) x params x 4 B with R = 2 nodes: an all-reduce of G bytes
  among R nodes must send at least 2 (R-1)/R x G bytes out of each node (reduce-scatter +
  all-gather bound; a ring meets it, so no extra ring factor), and each node's shards
  together hold the whole fp32 gradient G. Wire bytes include Ethernet/IP/TCP headers and
  ACKs; "headers off" subtracts 66 B per packet.
- **d scaling / mesh build**: `new_group calls` is torch's own counter
  (`_world.group_count`, default group included); groups held come from
  `_world.pg_map` on rank 0, real vs "fake" (size-1 dims). Mesh build times are on an
  existing process group under torchrun; `all_dims_real` gives every dim a real group of
  its own (size-1 dims and flattened dims that repeat another dim's groups included: the
  build before those became fake / shared), `needed_dims_only` what a plain user builds.
"""


def markdown(results: dict, rows) -> str:
    """RESULTS.md: the table, the machine, the command that reproduces it."""
    m = results["machine"]
    load0 = tuple(round(x, 2) for x in m["loadavg_start"])
    load1 = tuple(round(x, 2) for x in m["loadavg_end"])
    lines = ["# ray_mesh benchmark results", "",
             f"Run {results['started']} .. {results['finished']} (UTC); quick={results['quick']}.",
             "", "Reproduce (from the repository root, on an otherwise idle machine):", "",
             "```", results["command"], "```", "",
             "| section | figure | value | target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    lines += ["", "## Machine", "",
              f"- nproc: {m['nproc']}, memory: {m['mem_gib']} GiB, {m['platform']}",
              f"- Python {m['python']}, torch {m['torch']}, ray {m['ray']}",
              f"- load average (1, 5, 15 min) at start {load0}, at end {load1}",
              "", "```", "$ free -g", m.get("free_g", ""), "```", "",
              "Every figure, per run, is in `benchmarks/results.json`.", "", NOTES]
    return "\n".join(lines)


def print_table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


# ----------------------------------------------------------------------------- main
def config(quick: bool) -> dict:
    if quick:
        return {"runs": 1, "sizes": [4], "step_workers": 4,
                "bringup_modes": ["plain", "ray_mesh", "torchrun"],
                "step_workloads": ["hsdp"],
                "step_contenders": ["torchrun", "ray_plain", "ray_mesh"],
                "steps_args": {"batch": 16, "warmup": 3, "steps_per_window": 5, "rounds": 3,
                               "timeout_s": 600},
                "metrics_runs": 1, "metrics_windows": 2,
                "scaling_sizes": [4], "scaling_runs": 1,
                "meshbuild_sizes": [4], "meshbuild_repeats": 1,
                "crossnode_model": {"width": 256, "layers": 2, "steps": 3, "warmup": 1},
                "slowlinks": {"rates": [100], "steps": 2},
                "diloco": {"rates": [20], "steps": 12, "every": 4}}
    return {"runs": 3, "sizes": [4, 8], "step_workers": 4,
            "bringup_modes": ["plain", "ray_mesh", "torchrun", "ray_mesh_nopf"],
            "step_workloads": ["hsdp", "tp_pp_mlp"],
            "step_contenders": ["torchrun", "ray_plain", "ray_mesh"],
            "steps_args": {"batch": 16, "warmup": 10, "steps_per_window": 20, "rounds": 15,
                           "timeout_s": 900},
            "metrics_runs": 2, "metrics_windows": 5,
            "scaling_sizes": [4, 8, 16], "scaling_runs": 1,
            "meshbuild_sizes": [4, 8, 16], "meshbuild_repeats": 3,
            "crossnode_model": {"width": 512, "layers": 4, "steps": 10, "warmup": 2},
            "slowlinks": {"rates": [1000, 100, 20], "steps": 5},
            "diloco": {"rates": [100, 20], "steps": 30, "every": 10, "compress": "int8",
                       "model": {"layers": 2}}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smallest settings (smoke runs)")
    p.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results.json"))
    p.add_argument("--results-md", help="also write the table as markdown (RESULTS.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help='override a config entry, e.g. --set runs=5 or '
                        '--set \'bringup_modes=["plain","ray_mesh"]\'')
    args = p.parse_args(argv)
    selected = args.only or list(SECTIONS)
    cfg = config(args.quick)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in cfg:
            p.error(f"--set {key}: unknown config key; known: {', '.join(sorted(cfg))}")
        cfg[key] = json.loads(value)
    results: dict = {"command": shlex.join(["python", "benchmarks/run.py",
                                             *(argv or sys.argv[1:])]),
                     "quick": args.quick, "config": cfg, "machine": machine(),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tmp = tempfile.mkdtemp(prefix="rmbench_")
    storage = os.path.join(tmp, "results")
    ray_started = False
    try:
        if RAY_SECTIONS & set(selected):
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
            results["bringup"] = section_bringup(cfg, storage)
        if "steps" in selected:
            results["steps"] = section_steps(cfg, storage)
        if "metrics" in selected:
            results["metrics"] = section_metrics(cfg, storage)
        if "scaling" in selected:
            runs = results.get("bringup", {}).get("runs")
            results["scaling"] = section_scaling(cfg, storage, runs)
        if ray_started:
            import ray

            ray.shutdown()
            ray_started = False
        if "meshbuild" in selected:
            results["meshbuild"] = section_meshbuild(cfg)
        if "crossnode" in selected:
            results["crossnode"] = section_crossnode(cfg)
        if "slowlinks" in selected:
            results["slowlinks"] = section_slowlinks(cfg)
        if "diloco" in selected:
            results["diloco"] = section_diloco(cfg)
    finally:
        if args.only and Path(args.out).exists():
            # A partial run updates its own sections and keeps the others' figures.
            kept = json.loads(Path(args.out).read_text())
            kept.setdefault("partial_runs", []).append(
                {k: results[k] for k in ("command", "started", "machine") if k in results})
            results = {**kept, **{k: results[k] for k in selected if k in results},
                       "partial_runs": kept["partial_runs"]}
        if ray_started:
            import ray

            ray.shutdown()
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    rows = table(results)
    print_table(rows)
    results["table"] = rows
    Path(args.out).write_text(json.dumps(results, indent=1, default=str))
    print(f"\nwrote {args.out}")
    if args.results_md:
        Path(args.results_md).write_text(markdown(results, rows))
        print(f"wrote {args.results_md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
