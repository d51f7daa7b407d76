"""Mesh-aware training metrics on Ray's metrics pipeline (``ray.util.metrics`` -> Prometheus).

There is no metrics object to create: what the train function passes to
``ray_mesh.report`` (``ray.train.report`` plus ray_mesh's bookkeeping) is the input. Inside a
``MeshConfig`` run every such report is read by the run's
:class:`~ray_mesh.observability.report.ReportRecorder`::

    for step in range(steps):
        loss = train_step(...)
        if (step + 1) % 10 == 0:
            ray_mesh.report({"step": step + 1, "loss": loss.item(),
                             "samples": (step + 1) * global_batch})

and becomes, with no further code, the console's progress line on rank 0, the series below
(``mesh_step``, ``mesh_step_seconds``, ``mesh_samples_per_second``, ``mesh_loss``, process
memory, ...), a ``mesh_report_<key>`` gauge per reported number, and the run's summary.

Why this shape:

* One way to report: Ray Train's report, through ``ray_mesh.report`` with the same
  arguments. A second API (a meter object, a ``log_step``) would be one more thing to learn
  and a second source of truth for the same step; replacing Ray's function would miss every
  name bound before it.
* One record into a Ray metric costs 10-20 us (measured on a 2-core VM;
  upstream: ray-metric-record-cost): the recorder only does bookkeeping per report and
  writes Ray's metrics at most every 2 s. Averages use counters (steps, step seconds,
  samples, tokens) so that PromQL ``rate()`` gives honest means between any two scrapes;
  gauges carry the latest window for a glance.
* Metrics must never break training: a failing record or a node whose metrics endpoint does
  not answer gives ONE warning per run and process (WARNING on each node's local rank 0,
  DEBUG elsewhere), and training goes on without exporting.

What is and is not measured:

* step time: the wall time between reports divided by the steps between them (the
  reported ``step`` key), so data loading and the report itself are in it.
* time in collectives per mesh dim: the wait sampler (:mod:`ray_mesh.observability.waits`,
  on under ``MeshConfig``) measures, with no code in the loop, the time the training thread
  is *blocked* in each dim's collectives (FSDP2's and TP's included), what
  :mod:`ray_mesh.observability.slow` names the slow rank/link from; :func:`probe_dims`
  measures each dim's all-reduce latency and bus bandwidth directly.
* memory: process RSS (psutil) on every device, and torch.cuda allocated / reserved / peak
  bytes on CUDA devices, at each window.

Every metric carries the tags of :func:`mesh_tags`: run, rank, node_rank, node_ip and the
rank's mesh coordinate (pp, dp_replicate, dp_shard, cp, tp). Ray exports a metric named
``mesh_x`` as ``ray_mesh_x`` (Ray adds the ``ray_`` prefix; counters get ``_total``).

The pieces, one job each: ``report`` (the recorder), ``export`` (metric definitions, tags,
the writer to Ray's metrics), ``dim_probe`` (:func:`probe_dims`), ``owner`` (who starts and
stops them). This module gathers them; :func:`probe_dims` is public as ``ray_mesh.probe_dims``.
"""

from ray_mesh.observability.dim_probe import probe_dims as probe_dims
from ray_mesh.observability.export import METRICS as METRICS
from ray_mesh.observability.export import check_endpoint as check_endpoint
from ray_mesh.observability.export import mesh_tags as mesh_tags
