"""The driver's ``ray-mesh status``: what a cluster and its runs look like from outside.

:mod:`.cluster` collects it (Ray's state, the Prometheus pages of every node, the layout and
replica-group files of each run, the slow-rank verdict) as a :class:`~.cluster.ClusterStatus`
and formats it as text; :mod:`.metrics` reads and checks the metrics pages; :mod:`.html`
renders the same status as one self-contained page. Nothing here runs on a worker: the
workers' side of observability (progress lines, metrics, hang and wait reports, the files
this command reads) is :mod:`ray_mesh.observability`.
"""
