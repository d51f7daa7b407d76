"""The planner's laboratory: what the benchmarks use to test the cost model, not what it runs.

* :mod:`.calibrate`: a step time from a one-node calibration plus modelled cross-node
  communication (``predict_calibrated``), the model ``benchmarks/slowlinks.py`` checks the
  product's prediction and pick against;
* :mod:`.gpipe`: the GPipe schedule as a flow shop (stages and the links between them);
* :mod:`.measure`: the calibration's collectives on a live process group (torch only).

They left ``ray_mesh.planning`` because nothing a user runs calls them: ``mesh: auto`` prices
layouts with :mod:`ray_mesh.planning.cost` and settles close calls with short trials on the
cluster itself (:mod:`ray_mesh.planning.trial`). They import the product's cost model, never
the other way round (``tests/unit/test_architecture.py``).
"""
