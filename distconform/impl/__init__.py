"""Implementations under test: the bundled reference and adapters, behind
``distconform.impl.api``."""
