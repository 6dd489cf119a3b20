"""Conformance suites written once against ``impl.api``, run by the harness on N ranks."""
