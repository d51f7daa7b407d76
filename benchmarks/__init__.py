"""ray_mesh benchmarks: run with ``python benchmarks/run.py [--quick]``."""
