"""The benchmark report: the table (every figure with its statistic named), RESULTS.md,
and which requested sections failed (``run.py`` exits non-zero on any)."""

from __future__ import annotations

from pathlib import Path

from benchmarks import paired

PAIRED = "median of paired ratios [q1, q3] n"
"""How every ratio row reads: the median of per-pair ratios (pair k = run or window k of
one variant against run or window k of the other), its quartiles, and the number of pairs."""


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"
    return str(v)


def _paired(r: dict | float) -> str:
    if not isinstance(r, dict):  # results.json files written before the quartiles were kept
        return _fmt(r)
    return f"{r['median_paired']:.3f} [{r['q1']:.3f}, {r['q3']:.3f}] n={r['rounds']}"


def failures(results: dict, selected: list[str]) -> list[str]:
    """'section: status' for every requested figure that is missing (failed or not run)."""
    out: list[str] = []

    def walk(where: str, node) -> None:
        if isinstance(node, dict):
            status = node.get("status")
            if isinstance(status, str) and status != "ok":
                out.append(f"{where}: {status[:300]}")
            for key, value in node.items():
                if key not in ("runs", "raw", "args", "config"):
                    walk(f"{where}.{key}", value)

    for name in selected:
        if name not in results:
            out.append(f"{name}: no result")
        else:
            walk(name, results[name])
    return out


def table(results: dict) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []

    def add(section, what, value, target=""):
        rows.append((section, what, _fmt(value), target))

    def status_only(section: str, node: dict) -> bool:
        if node.get("status", "ok") != "ok":
            add(section, "status", node["status"])
            return True
        return False

    b = results.get("bringup")
    if b and not status_only("a bring-up", b):
        for key, row in b.items():
            if key.startswith("workers_"):
                n = key.split("_")[1]
                for m in ("plain", "ray_mesh", "torchrun", "ray_mesh_nopf"):
                    if f"{m}_ready_s" in row:
                        add("a bring-up", f"{n} workers {m} ready s (median of runs)",
                            row[f"{m}_ready_s"])
                r = row["ray_mesh_vs_plain"]
                add("a bring-up", f"{n} workers ray_mesh / plain ready s, {PAIRED}",
                    _paired(r), "<= 1.10")
    for name, w in (results.get("steps") or {}).items():
        if status_only("b steps", w):
            continue
        for c in paired.KNOWN_CONTENDERS:
            if f"{c}_step_s" in w:
                add("b steps", f"{name}: {c} s/step (median of windows)", w[f"{c}_step_s"])
        for a, b_ in paired.RATIO_PAIRS:
            r = w.get(f"{a}_vs_{b_}")
            if r:
                add("b steps", f"{name}: {a} / {b_} wall s/step, {PAIRED}", _paired(r),
                    "<= 1.03" if (a, b_) == ("ray_mesh", "torchrun") else "")
        r = w.get("ray_mesh_vs_torchrun_cpu")
        if r:
            add("b steps", f"{name}: ray_mesh / torchrun CPU s/step, {PAIRED}", _paired(r))
    m = results.get("metrics")
    if m and not status_only("e metrics", m):
        add("e metrics", "hsdp: report bookkeeping overhead us/step (difference of window "
            "medians)",
            m["overhead_us_per_step"])
        r = m["metered_vs_plain"]
        add("e metrics", f"hsdp: metered / plain s/step, {PAIRED}", _paired(r))
        add("e metrics", "report bookkeeping (ReportRecorder.observe) per call, us (median of "
            "runs)",
            m["empty_step_us"])
    c = results.get("crossnode")
    if c and not status_only("c cross-node", c):
        add("c cross-node", "params", c["params"])
        add("c cross-node", "minimum B/step (8 x params)", c["minimum_bytes_per_step"])
        add("c cross-node", "HSDP wire B/step (mean over the steps, one run)",
            c["hsdp"]["wire_bytes_per_step"])
        add("c cross-node", "HSDP / minimum (wire)", c["hsdp_vs_min_wire"], "<= 1.10")
        add("c cross-node", "HSDP / minimum (headers off)", c["hsdp_vs_min_payload"])
        add("c cross-node", "flat FSDP wire B/step", c["fsdp"]["wire_bytes_per_step"])
        add("c cross-node", "flat FSDP / HSDP (wire)", c["fsdp_vs_hsdp_wire"])
    sc = results.get("scaling")
    if sc and not status_only("d scaling", sc):
        for key, row in sc.items():
            n = key.split("_")[1]
            add("d scaling", f"{n} workers MeshConfig ready s (median of {row['runs']})",
                row["ready_s"])
            add("d scaling", f"{n} workers new_group calls / groups held (rank 0)",
                f"{row.get('rank0_new_group_calls')} / {row.get('rank0_real_groups_held')}"
                f" real + {row.get('rank0_fake_groups_held')} fake")
    mb = results.get("meshbuild")
    if mb and not status_only("d mesh build", mb):
        for key, row in mb.items():
            if not key.startswith("ranks_"):
                continue
            n = key.split("_")[1]
            for variant, v in row.items():
                add("d mesh build", f"{n} ranks {variant}: s (median) / new_group / real "
                    f"groups", f"{v['seconds']:.3f} / {v['new_group_calls']} / "
                    f"{v['real_groups_held']}")
    rec = results.get("recovery")
    if rec and not status_only("f recovery", rec):
        for where in ("local", "netns"):
            r = rec.get(where)
            if r is None or status_only(f"f recovery {where}", r):
                continue
            add("f recovery", f"{where}: SIGKILL -> first step after resume, s (one run)",
                r["recovery_s"])
            add("f recovery", f"{where}: SIGKILL -> restored train function starts, s",
                r["kill_to_restart_s"])
            add("f recovery", f"{where}: fit() -> first step, s", r["fit_to_first_step_s"])
            if "cluster_up_s" in r:
                add("f recovery", f"{where}: virtual cluster up (2 nodes), s",
                    r["cluster_up_s"])
    for rate, sec in (results.get("slowlinks") or {}).items():
        if not isinstance(sec, dict) or "pick" not in sec:
            continue
        errs = [abs(v["step_error"]) for v in sec.values()
                if isinstance(v, dict) and "step_error" in v]
        add("g slow links", f"{rate}: planner's pick / measured fastest (median step)",
            f"{sec['pick']} / {sec['fastest']} = {sec['pick_vs_fastest']:.2f}", "<= 1.05")
        add("g slow links", f"{rate}: worst |predicted / measured - 1| over layouts",
            max(errs), "<= 0.15")
        if (trial := sec.get("trial")) and trial.get("pick"):
            add("g slow links", f"{rate}: mesh: auto trials' pick / measured fastest "
                "(median step); trials' wall time, s",
                f"{trial['pick']} / {sec['fastest']} = {trial['pick_vs_fastest']:.2f}; "
                f"{trial['seconds']:.0f} s", "<= 1.05")
        lays = {k: v for k, v in sec.items() if isinstance(v, dict) and "step_error" in v}
        add("g slow links", f"{rate}: predicted / measured - 1, per layout",
            ", ".join(f"{k} {v['step_error']:+.2f}" for k, v in lays.items()))
        if all("analytic_step_s" in v for v in lays.values()):
            add("g slow links", f"{rate}: worst |error| of the uncalibrated (analytic) model",
                max(abs(v["analytic_step_s"] / v["measured_step_s"] - 1)
                    for v in lays.values()))
        if "loadavg_1m_before_after" in sec:
            add("g slow links", f"{rate}: 1-min load average before / after (2 cores)",
                " / ".join(f"{x:.1f}" for x in sec["loadavg_1m_before_after"]))
        hsdp, hsdp_bf16 = HSDP_2X2, HSDP_2X2.replace("/fp32/", "/bf16/")
        if hsdp in sec and hsdp_bf16 in sec:
            add("g slow links", f"{rate}: hsdp ({hsdp}) bf16 / fp32 cross-node bytes per step",
                sec[hsdp_bf16]["cross_node_bytes_per_step"]
                / sec[hsdp]["cross_node_bytes_per_step"], "0.5 +- 10%")
    wg = results.get("wireguard")
    if wg and not status_only("h wireguard", wg):
        for rate, value in (wg.get("step_vs_veth") or {}).items():
            target = "<= 1.10" if rate != "unshaped" else "report"
            add("h wireguard", f"{rate}: HSDP step, WireGuard / veth (median step)", value,
                target)
            add("h wireguard", f"{rate}: HSDP cross-node bytes on the wire, WireGuard / veth",
                wg["bytes_vs_veth"][rate])
            rows_ = wg["predicted_vs_measured"].get(rate) or {}
            if rows_:
                add("h wireguard", f"{rate}: worst |predicted / measured - 1| on WireGuard",
                    max(abs(v - 1) for v in rows_.values()), "<= 0.15")
        ck = wg.get("checkpoint_bucket_vs_local") or {}
        if "save" in ck:
            add("h wireguard", "checkpoint save / restore, S3 bucket (moto) / local dir "
                "(median)", f"{ck['save']:.2f} / {ck['restore']:.2f}")
    for rate, sec in (results.get("rendezvous") or {}).items():
        if not isinstance(sec, dict) or "send_per_microbatch_ms" not in sec:
            continue
        for key, v in sec.items():
            if isinstance(v, dict) and not key.endswith("/compute_0ms"):
                add("g pipeline sends", f"{rate} {key}: measured / take turns / in parallel "
                    "/ side by side, ms (median of repeats)",
                    " / ".join(f"{v[k]:.0f}" for k in ("measured_ms", "serial_ms",
                                                       "overlapped_ms", "side_by_side_ms")))
    for rate, sec in (results.get("diloco") or {}).items():
        if not isinstance(sec, dict) or "diloco_tokens_s" not in sec:
            continue
        tag = f"{rate}, H={sec['every']} {sec['compress']}"
        shaped = rate != "unshaped"
        d, s, free = sec["diloco_tokens_s"], sec["sync_tokens_s"], sec["unshaped_tokens_s"]
        add("h diloco", f"{tag}: tokens/s diloco / sync / unshaped sync",
            f"{d:.0f} / {s:.0f} / {free:.0f} (diloco {d / free:.2f}x unshaped, "
            f"{d / s:.2f}x sync)",
            (">= 0.90x unshaped" + (", >= 3x sync" if rate == "20mbit" else ""))
            if shaped else "")
        every = sec["every"]
        bound = sec.get("checks", {}).get("bytes_bound_per_step")
        add("h diloco", f"{tag}: cross-node bytes/step diloco / sync",
            f"{sec['diloco_cross_node_bytes_per_step']:.3g} / "
            f"{sec['sync_cross_node_bytes_per_step']:.3g}",
            f"diloco <= sync/{every} x compression = {bound:.3g}" if bound and shaped else "")
        vd, vs = sec["diloco_val_loss"], sec["sync_val_loss"]
        add("h diloco", f"{tag}: val loss diloco / sync (same tokens)",
            f"{vd:.3f} / {vs:.3f} ({(vd / vs - 1) * 100:+.1f}%)", "within 3%" if shaped else "")
    lm = results.get("llm")
    if lm and not status_only("i llm", lm):
        warm = lm["args"]["warmup"]
        for v in ("torchrun", "ray_mesh"):
            add("i llm", f"{v}: tokens/s (steps after the first {warm}; median of runs)",
                lm[v]["tokens_per_s"])
            add("i llm", f"{v}: batch wait / step; first batch s; bring-up s (medians)",
                f"{lm[v]['batch_wait_fraction']:.2%}; {lm[v]['first_batch_s']:.1f}; "
                f"{lm[v]['bring_up_s']:.1f}")
        add("i llm", f"ray_mesh / torchrun tokens/s, {PAIRED}",
            _paired(lm["ray_mesh_vs_torchrun"]), ">= 0.95")
    if "user_job" in results:
        from benchmarks.user_job_md import rows as user_job_rows

        rows += user_job_rows(results["user_job"])
    s = results.get("slow")
    if s and not status_only("j slow", s):
        for key, what, target in (
                ("detect_slow_link_s", "slow link named by status, s after training start",
                 "<= 60"),
                ("detect_slow_rank_s", "slow rank named by status, s after training start",
                 "<= 60"),
                ("wait_sampler_overhead", "wait sampler: step with / without - 1 (median)",
                 "< 0.01"),
                ("wait_sampler_share_of_time", "wait sampler: sample cost / interval",
                 "< 0.01")):
            if key in s:
                add("j slow", what, s[key], target)
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
  What is compared: Ray starts workers at niceness 15 and `ray_plain` keeps it;
  `ray_mesh` resets its workers to 0 (`MeshConfig(worker_niceness=0)`, the default), as
  torchrun's ranks run. `ray_plain_nice0` is plain Ray Train whose train function resets
  niceness the same way (`ray_mesh.core.priority.set_niceness(0)`): `ray_mesh /
  ray_plain_nice0` is ray_mesh's own cost at equal niceness, `ray_plain_nice0 / ray_plain`
  the niceness reset alone. Every contender's idle rank 0 polls the baton directory
  (`baton.POLL_S`) while the others run, the same for all of them.
- **e metrics**: one `MeshConfig` run per repeat, windows alternate plain / with every step's
  loss handed to `ReportRecorder.observe` (what `ray_mesh.report` adds to `ray.train.report`; paired
  median of metered/plain); plus the cost of one `observe` call (20 000 calls; the recorder
  flushes every 2 s and 20 000 calls take well under that, so no flush falls in that figure,
  while the step windows above do include the flushes that fall in them). Figures dated
  before 2026-11-25 measured the former `StepMeter.step()` instead (removed: one way to
  report a step, `ray_mesh.report`). Which of the two window
  kinds comes first alternates from run to run (since 2026-11-23; before, plain first).
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
- **f recovery**: `benchmarks/recovery.py`: one `MeshConfig` run of 4 workers (HSDP 2x2,
  FSDP2, checkpoint every 2 steps, `FailureConfig(max_failures=1)`) in which worker rank 1
  SIGKILLs itself after step 5; seconds from the kill (its marker file's mtime) to the
  first step completed after Ray Train restarted the group and the run restored its last
  checkpoint (`recovery_s`), to the restored train function's start (`kill_to_restart_s`),
  and from `fit()` to the first step (`fit_to_first_step_s`). `local` on the benchmark's
  local Ray; `netns` on the virtual cluster (2 namespace nodes x 2 workers over
  `tailscale0`), whose bring-up (namespaces + `ray start` per node) is `cluster_up_s`.
  Ray Train's default health check interval (2 s) is kept. One run each: no spread.
- **g slow links**: `benchmarks/slowlinks.py`: 2 namespace nodes x 2 workers, both node
  links shaped with `tc tbf` per rate; every candidate layout of `fsdp_tp_transformer` for
  a fixed number of steps (median step, bytes from the `tailscale0` counters). The
  prediction is `benchmarks.planning_lab.calibrate.predict_calibrated`: a calibration run once per
  benchmark run, on each node alone (nothing crossing nodes, the layouts' own steps never
  timed for it), plus modelled link time; the uncalibrated analytic model beside it.
- **h wireguard**: `benchmarks/wireguard.py`: the g slow links measurement on a bare-veth
  cluster and on a WireGuard one (`wireguard-go`, MTU 1280, the `tbf` on the link under the
  tunnel), taking turns rate by rate (unshaped, 100, 20 Mbit/s). Step: the HSDP layout's median
  timed step, WireGuard over veth; bytes: its cross-node bytes per step counted on the link
  under the tunnel (what the wire carries); prediction: every layout's calibrated prediction
  over its measured median step, on WireGuard. Checkpoints: local Ray, HSDP 2x2, a
  `Checkpointer` saving through Ray Train to a local directory and to a moto bucket
  (`ray-mesh storage serve`), taking turns; median over the runs of the slowest rank's seconds
  in `report()` at a save step and in `restore()`, bucket over local.
- **g pipeline sends**: `benchmarks/rendezvous.py`: 2 namespace nodes x 2 ranks at 20 Mbit/s,
  gloo; each rank of node 0 sends 4 microbatches of 64 KiB to its peer as torch's GPipe
  does, the receivers sleep c between recvs, posting each recv just before it is needed
  (`late`, torch's order), all up front (`early`), or late and held in lockstep as TP
  ranks are (`late_tp`). Beside: the two models of `benchmarks.planning_lab.gpipe` (take turns,
  in parallel) and the planner's side-by-side model for independent pipelines.
- **i llm**: `benchmarks/llm.py`: `examples/llm.py` + `examples/llm.yaml` (dp_shard 2 x tp 2,
  4 CPU workers), torchrun with in-memory rows vs the job through ray_mesh's runner with Ray
  Data input, runs alternating; tokens/s from rank 0's per-step seconds inside the train loop
  (warm-up steps excluded), bring-up = launch -> first step.
"""


HSDP_2X2 = "dp_replicate=2,dp_shard=2/fp32/sync"
"""The slow-links benchmark's HSDP layout (2 nodes x 2), as ray_mesh.core.layout prints it:
its results are keyed by the layouts' canonical strings."""


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
              f"Every figure, per run, is in `{results.get('out', 'benchmarks/results.json')}`.",
              "", NOTES]
    return "\n".join(lines)


# RESULTS.md is written anew by every `run.py --results-md`; what lies below this line is
# written by hand (the figures of runs outside run.py's table: pooled and repeat runs, the
# detailed tables the manual points to) and is carried over from the file being replaced.
NOTES_MARK = "<!-- Hand-written notes below: benchmarks/run.py --results-md keeps them. -->"


def kept_notes(previous: str | None) -> str:
    """The hand-written part of a previous RESULTS.md (from NOTES_MARK on), or ''."""
    if not previous or NOTES_MARK not in previous:
        return ""
    return previous[previous.index(NOTES_MARK):]


def write_markdown(path: str | Path, results: dict, rows) -> None:
    """Write RESULTS.md at ``path``: the generated part, then the notes the old file had."""
    path = Path(path)
    previous = path.read_text() if path.exists() else None
    notes = kept_notes(previous)
    text = markdown(results, rows).rstrip("\n") + "\n"
    path.write_text(text + ("\n" + notes if notes else ""))


def print_table(rows) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)] if rows else [0] * 4
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


