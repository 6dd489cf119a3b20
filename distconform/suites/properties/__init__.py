"""Property-based conformance cases (Hypothesis).

Examples are drawn in the pytest process and each one runs on its own ranks through
:func:`harness.run_in_session` on the thread launcher (world sizes 1 to 8
cost one host process each, whatever the session's launcher). Profiles:

- ``distconform-ci`` (the default): derandomized, 3 examples at world sizes up to 4, no
  example database, so every run of the default suite draws the same examples;
- ``distconform-slow``: derandomized, many examples (the ``slow`` tests use it);
- ``distconform-explore``: random, many examples, for hunting new counterexamples.

Choose with ``DISTCONFORM_HYPOTHESIS_PROFILE``. A failure prints the example and a command
that replays just that example (``DISTCONFORM_PROPERTY_EXAMPLE``).
"""
