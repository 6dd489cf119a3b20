"""Conformance suites written once against ``distconform.impl.api``, run by the harness on
N ranks."""
