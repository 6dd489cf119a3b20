"""Hooks other plugins implement to extend distconform."""

from __future__ import annotations

import pytest


def pytest_distconform_reproducer_args(config: pytest.Config) -> list[str]:
    """Extra command-line arguments a reproducer command needs (e.g. ``--impl torch``).

    Every implementation's list is appended, in plugin order.
    """
    raise NotImplementedError


@pytest.hookspec(firstresult=True)
def pytest_distconform_reproducer_command(config: pytest.Config) -> list[str] | None:
    """What follows the interpreter in a reproducer command, before the test id: ``["-m",
    "pytest"]`` when no plugin answers. A session started by another command (``python -m
    distconform conformance``, whose test ids are relative to the package) answers with
    that command, so the printed line works from the directory the run started in.

    The first plugin to answer decides.
    """


@pytest.hookspec(firstresult=True)
def pytest_distconform_expects_ranks(config: pytest.Config) -> bool | None:
    """True when this session is sure to run distributed tests whose ranks load
    ``torch._dynamo`` from the start (torch's own test package imports it): the rank fork
    server then starts at configure, its torch import beside pytest's own, and loads that
    too before its first fork, once for every rank.

    Asked once, at configure, before torch is imported; the first plugin to answer decides.
    """


@pytest.hookspec(firstresult=True)
def pytest_distconform_pool_choice(item: pytest.Item):
    """Where a distributed item runs, when not on the session's launcher and backend, or on
    a pool of its own: a :class:`distconform.harness.controller.item_settings.PoolChoice`, or None.

    Asked once per item, at setup; the first plugin to answer decides.
    """
