"""Ray Train glue: ``MeshConfig`` and its backend (Train controller), the workers' setup, the
elastic policy and the cluster checks (driver). The job runner that drives them is
``ray_mesh.cli.runner``. Everything in this package imports Ray; the core it calls does not.
"""
