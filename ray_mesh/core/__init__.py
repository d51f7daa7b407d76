"""The Ray-free core: the mesh spec, the plan that fits it onto workers, and the worker bootstrap.

Runs on workers (under Ray Train or torchrun) and on the driver for validation. Nothing here
imports Ray: ``tests/unit/test_architecture.py`` keeps it that way.
"""
