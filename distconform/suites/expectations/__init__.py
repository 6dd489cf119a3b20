"""Expectations of the bundled implementations (``<spec>.toml``); format in
:mod:`distconform.conformance.expectations`.

A suite that compares numbers takes the ``conformance_tolerance`` fixture (from
``distconform.conformance.plugin``; it pickles, so rank bodies can take it too) and passes
``conformance_tolerance.resolve(rtol, atol)`` to ``distconform.harness.parity``: the
implementation's ``[[tolerance]]`` override where its expectations file has one, the test's own
values otherwise. This package holds data only: the suites sit below ``conformance`` and import
nothing from it.
"""
