"""Conformance runs: an implementation under test, the suites' case table, a report to publish.

Built on :mod:`harness` (ranks, pools, per-rank reports), :mod:`impl` (the implementations
and their adapters) and :mod:`suites` (the cases); none of them imports this package.

- :mod:`distconform.conformance.plugin`: the pytest plugin (entry point
  ``distconform-conformance``): ``--impl`` and the ``impl`` fixture, the case table at collection,
  ``--expectations``, and the report (``--conformance-out``, ``--conformance-table``).
- :mod:`distconform.conformance.report`: PASS / FAIL / XFAIL / XPASS / UNSUPPORTED / SKIP per test,
  counted per profile, feature and world size; JSON, Markdown and JUnit.
- :mod:`distconform.conformance.expectations`: per-implementation expected failures and tolerance
  overrides (TOML), and :mod:`distconform.conformance.tolerance`.
- :mod:`distconform.conformance.hookspecs`: ``pytest_distconform_conformance_profiles``.
- :mod:`distconform.conformance.cli`: ``python -m distconform conformance`` (also ``python -m
  conformance``).
"""
