"""The network layer (Ray-free): interface choice, the bounded pre-flight probe and its report.

Runs on workers and node agents; the Ray side that fans these out lives in ``ray_mesh.raytrain``.
"""
