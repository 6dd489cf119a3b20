"""distconform: run distributed PyTorch tests on N ranks under pytest, and prove that a
sharded data-parallel implementation or a communication backend behaves like the reference.

The one import name distconform claims. Its folders:

- :mod:`distconform.harness`: ranks as processes or threads, warm pools, failure reports;
- :mod:`distconform.impl`: the reference implementation and the adapters of others;
- :mod:`distconform.suites`: the conformance suites;
- :mod:`distconform.conformance`: the run, its report, compare and history.

Importing this package imports nothing else (no torch), so ``distconform --help`` and the
fork server's clients stay light.
"""

__version__ = "0.1.0"
