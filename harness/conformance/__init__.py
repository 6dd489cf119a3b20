"""Conformance runs: the report, expectations files and vendor plug-ins.

- :mod:`harness.conformance.plugin`: the pytest plugin (``--conformance-out``,
  ``--expectations``) that classifies every test as PASS / FAIL / XFAIL / XPASS /
  UNSUPPORTED / SKIP and writes the JSON, Markdown and JUnit files.
- :mod:`harness.conformance.expectations`: per-implementation expected failures and
  tolerance overrides (TOML).
- :mod:`harness.conformance.backend_plugins`: ``--backend-plugin`` modules, imported in the
  parent and in every rank before the process group starts.
- :mod:`harness.conformance.cli`: ``python -m harness conformance``.

This is the one part of ``harness`` that knows about the conformance surface
(``impl.api``), and only to describe the implementation in the report's header; it imports
it lazily, so the rest of the harness stays usable for any distributed test.
"""
