"""What the workers make visible: metrics, the layout file (rank 0), progress lines, the hang
watch (every rank; ``hang``, Ray-free), the slow-rank verdict, and the run files that the
driver's ``ray-mesh status`` (:mod:`ray_mesh.status`) reads back. Modules that need Ray import
it lazily, inside functions.
"""
