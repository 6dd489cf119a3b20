"""The ``distconform`` section of ``pytest --help``, which each of the harness's plugin
modules adds its own options to."""

from __future__ import annotations

import pytest


def option_group(parser: pytest.Parser) -> pytest.OptionGroup:
    return parser.getgroup("distconform", "distributed tests on N ranks (distconform)")
