"""Binding a collective's arguments by name: the fast path must agree with ``inspect``."""

from __future__ import annotations

import inspect

import pytest
import torch.distributed.distributed_c10d as c10d

from distconform.harness.comm.records import BARRIER_FUNCTIONS, DIST_FUNCTIONS, _ArgumentBinder

_FUNCTIONS = sorted(name for name in (*DIST_FUNCTIONS, *BARRIER_FUNCTIONS) if hasattr(c10d, name))


def _call_shapes(signature: inspect.Signature):
    """Every way to pass the first k parameters: all by position, all by name, or split."""
    names = list(signature.parameters)
    for count in range(len(names) + 1):
        given = [f"<{name}>" for name in names[:count]]
        for split in range(count + 1):
            yield tuple(given[:split]), dict(zip(names[split:count], given[split:], strict=True))


def _expected(signature: inspect.Signature, args: tuple, kwargs: dict):
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        return TypeError
    bound.apply_defaults()
    return dict(bound.arguments)


@pytest.mark.parametrize("name", _FUNCTIONS)
def test_the_binder_names_arguments_as_inspect_does(name):
    func = getattr(c10d, name)
    signature = inspect.signature(func)
    binder = _ArgumentBinder(func)
    for args, kwargs in _call_shapes(signature):
        expected = _expected(signature, args, kwargs)
        if expected is TypeError:
            # A required parameter left out: the collective itself will say so.
            assert set(binder.bind(args, kwargs)) < set(signature.parameters)
        else:
            assert binder.bind(args, kwargs) == expected, (args, kwargs)


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [
        (("<t>", "<op>", "<group>", "<async>", "<extra>"), {}),  # one argument too many
        (("<t>",), {"tensor": "<t>"}),  # the same parameter twice
        (("<t>",), {"no_such_parameter": 1}),
    ],
)
def test_a_call_python_would_refuse_is_refused(args, kwargs):
    with pytest.raises(TypeError):
        _ArgumentBinder(c10d.all_reduce).bind(args, kwargs)
