"""Implementations under test: the bundled reference and adapters, behind ``impl.api``."""
