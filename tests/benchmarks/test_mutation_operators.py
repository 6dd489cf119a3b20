"""The mutation benchmark's operators: each makes the change it names on a small snippet, and
leaves alone what the benchmark promises never to mutate (benchmarks/mutation_operators.py)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from mutation_operators import OPERATORS, mutations_of  # scripts beside each other, not a package

SNIPPET = '''\
"""Module docstring: < and True are not code."""

import math
from typing import TYPE_CHECKING

import torch

__all__ = ["Group"]
LIMIT = 3 < 4

if TYPE_CHECKING:
    from typing import Any


class Policy:
    cast_inputs: bool = True


class Group:
    def step(self, work, x: list[int], async_op: bool = False, *, unused: int = 0) -> int:
        """What step does; `x < 3` here is prose."""
        if self.ready and not self.done:
            self.unshard(async_op=async_op)
        work.wait()
        x.register_hook(self.pre_backward)
        y = x[: self.n + 1]
        z = x.narrow(0, self.offset, self.rows)
        out = z.to(self.compute_dtype, torch.float32)
        keep = self.orig_dtype
        torch.accelerator.current_stream().synchronize()
        self.reduce()
        self.reshard()
        if y < 3:
            raise ValueError(f"y < 3: {y == 3}")
        assert out is not None
        return math.ceil(y / 2)
'''


def mutated(operator: str) -> list[str]:
    return [
        m.apply(SNIPPET.encode()).decode() for m in mutations_of(SNIPPET) if m.operator == operator
    ]


def line_changes(operator: str) -> set[tuple[str, str]]:
    """(original line, mutated line) of each one-line mutant of ``operator``."""
    before = SNIPPET.splitlines()
    changes = set()
    for text in mutated(operator):
        after = text.splitlines()
        if len(after) == len(before):
            diff = [(a.strip(), b.strip()) for a, b in zip(before, after, strict=True) if a != b]
            if len(diff) == 1:
                changes.add(diff[0])
    return changes


def test_every_operator_makes_mutants_and_each_mutant_parses():
    mutations = mutations_of(SNIPPET)
    assert {m.operator for m in mutations} == set(OPERATORS)
    for mutation in mutations:
        ast.parse(mutation.apply(SNIPPET.encode()))


@pytest.mark.parametrize(
    ("operator", "before", "after"),
    [
        ("drop-call", "self.reduce()", "pass"),
        ("skip-hook", "x.register_hook(self.pre_backward)", "pass"),
        ("remove-wait", "work.wait()", "pass"),
        ("flip-bool", "if self.ready and not self.done:", "if self.ready or not self.done:"),
        ("flip-bool", "if self.ready and not self.done:", "if self.ready and (self.done):"),
        ("flip-bool", "if self.ready and not self.done:", "if not (self.ready and not self.done):"),
        ("flip-bool", "cast_inputs: bool = True", "cast_inputs: bool = False"),
        ("flip-compare", "if y < 3:", "if y <= 3:"),
        ("drop-kwarg", "self.unshard(async_op=async_op)", "self.unshard()"),
        ("off-by-one", "y = x[: self.n + 1]", "y = x[: self.n]"),
        ("off-by-one", "y = x[: self.n + 1]", "y = x[: self.n + 2]"),
        (
            "off-by-one",
            "z = x.narrow(0, self.offset, self.rows)",
            "z = x.narrow(0, self.offset + 1, self.rows)",
        ),
        (
            "off-by-one",
            "z = x.narrow(0, self.offset, self.rows)",
            "z = x.narrow(0, self.offset, self.rows - 1)",
        ),
        ("off-by-one", "return math.ceil(y / 2)", "return math.floor(y / 2)"),
        (
            "swap-dtype",
            "out = z.to(self.compute_dtype, torch.float32)",
            "out = z.to(self.orig_dtype, torch.float32)",
        ),
        (
            "swap-dtype",
            "out = z.to(self.compute_dtype, torch.float32)",
            "out = z.to(self.compute_dtype, torch.float64)",
        ),
    ],
)
def test_the_operator_makes_the_change_it_names(operator, before, after):
    assert (before, after) in line_changes(operator)


def test_ignore_param_overwrites_a_read_parameter_with_its_default_after_the_docstring():
    texts = mutated("ignore-param")
    assert len(texts) == 1, "`unused` is never read: ignoring it would change nothing"
    lines = texts[0].splitlines()
    docstring = next(i for i, line in enumerate(lines) if "What step does" in line)
    assert lines[docstring + 1] == "        async_op = False"


def test_swap_statements_swaps_two_adjacent_calls():
    swapped = [
        t for t in mutated("swap-statements") if "self.reshard()\n        self.reduce()" in t
    ]
    assert len(swapped) == 1


def test_what_is_never_mutated():
    mutations = mutations_of(SNIPPET)
    lines = SNIPPET.splitlines()
    touched = {
        line
        for m in mutations
        if m.operator not in {"ignore-param", "swap-statements"}
        for line in lines[m.first_line - 1 : m.last_line]
    }
    never = [
        '"""Module docstring: < and True are not code."""',
        "LIMIT = 3 < 4",  # module level
        '        """What step does; `x < 3` here is prose."""',
        '            raise ValueError(f"y < 3: {y == 3}")',
        "        assert out is not None",
        "        torch.accelerator.current_stream().synchronize()",  # accelerator only
        '__all__ = ["Group"]',
    ]
    for line in never:
        assert line not in touched, line
    # Annotations are not indexed, and `x: list[int]` gets no off-by-one.
    assert not any("list[int" in t and "list[int]" not in t for t in mutated("off-by-one"))


def test_mutations_are_byte_splices_that_keep_the_rest_of_the_file():
    source = SNIPPET.replace("# ", "#").encode()
    for mutation in mutations_of(source):
        out = mutation.apply(source)
        assert out[: mutation.start] == source[: mutation.start]
        assert out[len(out) - (len(source) - mutation.end) :] == source[mutation.end :]


def test_non_ascii_text_before_a_site_keeps_offsets_right():
    source = 'def f(a, b):\n    s = "µ≠"; return a < b\n'
    (mutation,) = [m for m in mutations_of(source) if m.operator == "flip-compare"]
    assert mutation.apply(source.encode()).decode().endswith("return a <= b\n")
