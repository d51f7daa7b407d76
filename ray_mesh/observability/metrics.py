"""Mesh-aware training metrics on Ray's metrics pipeline (``ray.util.metrics`` -> Prometheus).

One :class:`StepMeter` per training process::

    from ray_mesh.observability.metrics import StepMeter, probe_dims

    meter = StepMeter(samples_per_step=batch * dp)
    for step in range(steps):
        with meter.step() as s:
            loss = train_step(...)
            s.loss = loss
        with meter.collective("dp"):          # a collective the loop issues itself
            dist.all_reduce(t, group=mesh.get_group("dp"))
    meter.close()

Why this shape:

* One record into a Ray metric costs 10-20 us (measured: Ray 2.60, 2-core VM), a toy HSDP
  step a few ms. So the per-step path only does bookkeeping (two ``perf_counter`` calls and a
  few additions); the Ray metric objects are created once per process and written at most
  once per ``flush_every_s`` (Ray's exporter and Prometheus sample every 10-15 s anyway).
* Averages use counters (steps, step seconds, samples, collective seconds per dim) so that
  PromQL ``rate()`` gives honest means between any two scrapes; gauges carry the latest
  window for a glance.
* Metrics must never break training: a failing metric record or a node whose metrics
  endpoint does not answer gives ONE warning per process (at WARNING level on each node's
  local rank 0, DEBUG elsewhere) and the meter goes on timing without exporting.

What is and is not measured:

* step time: host wall time inside ``with meter.step()``. On CUDA the host may run ahead of
  the GPU, so a single step can look short or long; the window mean and the counters are
  right over many steps because the CUDA launch queue is bounded.
* time in collectives per mesh dim: only the collectives the train loop wraps in
  ``meter.collective(dim)``. On CPU (gloo) the wall time of the blocking call; on CUDA the
  time between two CUDA events recorded on the current stream around the call (the stream
  waits for the collective), read at flush time. Collectives issued inside FSDP2,
  tensor-parallel modules or pipelining are NOT seen: they overlap compute and measuring
  them needs the torch profiler. :func:`probe_dims` measures each dim's all-reduce latency
  and bus bandwidth directly instead, and the wait sampler
  (:mod:`ray_mesh.observability.waits`, on under ``MeshConfig``) measures, with no code in
  the loop, the time the training thread is *blocked* in each dim's collectives (FSDP2's
  and TP's included): what :mod:`ray_mesh.observability.slow` names the slow rank/link from.
* memory: process RSS (psutil) on every device, and torch.cuda allocated / reserved / peak
  bytes on CUDA devices.

Every metric carries the tags of :func:`mesh_tags`: run, rank, node_rank, node_ip and the
rank's mesh coordinate (pp, dp_replicate, dp_shard, cp, tp). Ray exports a metric named
``mesh_x`` as ``ray_mesh_x`` (Ray adds the ``ray_`` prefix; counters get ``_total``).

The pieces, one job each: ``meter`` (:class:`StepMeter`, the per-step bookkeeping),
``export`` (metric definitions, tags, the writer to Ray's metrics), ``dim_probe``
(:func:`probe_dims`). This module is the public entry point that gathers them.
"""

from ray_mesh.observability.dim_probe import probe_dims
from ray_mesh.observability.export import (
    METRICS,
    METRICS_BY_NAME,
    MetricDef,
    check_endpoint,
    mesh_tags,
    run_name,
)
from ray_mesh.observability.meter import MESH_DIMS, StepMeter

__all__ = ["MESH_DIMS", "METRICS", "METRICS_BY_NAME", "MetricDef", "StepMeter", "check_endpoint",
           "mesh_tags", "probe_dims", "run_name"]
