"""Ray Train glue: ``MeshConfig`` and its backend (Train controller), the job runner and the
elastic policy (driver). Everything in this package imports Ray; the core it calls does not.
"""
