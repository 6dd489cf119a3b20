"""The backend suite: conformance of a c10d communication backend, not of an implementation.

Reading order: ``declaration`` (the capabilities a backend declares, and the bundled
declarations in ``declarations/``), ``contributions`` (every rank's deterministic input),
``oracle`` (the exact result and the ``Findings`` an item reports), ``collectives`` (the
grids and reduce ops the tests share), then the tests: ``test_reductions``,
``test_data_movement``, ``test_point_to_point``, ``test_groups``, ``test_async``,
``test_functional``, ``test_errors``. Cases are rows of ``cases.toml``; known differences of
a bundled backend are in ``expectations/<backend>.toml``. ``bandwidth`` is the
``python -m distconform bench-collectives`` benchmark.
"""
