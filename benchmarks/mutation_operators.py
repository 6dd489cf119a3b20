"""The mutation operators of ``benchmarks/mutation.py``: where a source file can be broken.

Each operator finds sites in one module's syntax tree and describes the change as a splice of
the source bytes (``Mutation``), so a mutant differs from the original only where it is
broken: comments, formatting and every other line stay byte for byte as they were, and the
mutated file is what the pytest process and the rank processes import.

What is never mutated, and why:

- module-level statements (imports, constants, ``__all__``, type aliases): breaking them
  fails every import, which says nothing about the suites;
- docstrings, string literals and f-strings (messages), ``assert`` and ``raise`` statements
  (the checks and refusals themselves; the conditions that lead to a ``raise`` are mutated),
  decorators, type annotations and ``if TYPE_CHECKING:`` blocks;
- statements that name the accelerator (``torch.accelerator``, streams, events,
  ``pin_memory``): on the CPU machines that run the benchmark they are unreachable or
  inert, so their mutants would survive whatever the suites check.
"""

from __future__ import annotations

import ast
import itertools
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

#: Every operator, by name, with what it does.
OPERATORS: dict[str, str] = {
    "drop-call": "a call statement replaced by `pass`",
    "skip-hook": "a hook or autograd-callback registration replaced by `pass`",
    "remove-wait": "a `wait()` / `wait_for_unshard()` / `synchronize()` statement removed",
    "flip-bool": "`True` / `False` flipped, `and` / `or` swapped, a `not` removed, a condition "
    "negated",
    "flip-compare": "`<` / `<=`, `>` / `>=`, `==` / `!=`, `is` / `is not`, `in` / `not in` swapped",
    "ignore-param": "a parameter with a default overwritten by that default on entry",
    "drop-kwarg": "a keyword argument left out of a call (the callee's default applies)",
    "off-by-one": "a slice bound, an index, a `narrow` / `range` argument +1 or -1; `ceil` / "
    "`floor` swapped",
    "swap-dtype": "a dtype replaced by another: `float32` / `float64`, `bfloat16` / `float16`, "
    "`self.compute_dtype` by `self.orig_dtype`",
    "swap-statements": "two adjacent statements of a block, one of them a call statement (or a "
    "block holding one), swapped",
}

_HOOK_CALL = re.compile(r"^register_\w*hook$|^queue_\w*callback$")
_WAIT_CALLS = frozenset({"wait", "wait_for_unshard", "synchronize"})
# Statements whose text names these only run (or only differ) on an accelerator.
_ACCELERATOR_ONLY = re.compile(
    r"torch\.accelerator|torch\.cuda|\.cuda\b|current_stream|wait_event|wait_stream|"
    r"record_event|pin_memory"
)
# zip(strict=True) only differs when the lengths differ, which correct code never makes.
_INERT_KEYWORDS = frozenset({"strict"})
_DTYPE_SWAPS = {
    "float32": "float64",
    "float64": "float32",
    "float": "double",
    "double": "float",
    "bfloat16": "float16",
    "float16": "bfloat16",
    "half": "bfloat16",
}
# Each comparison: (the operator as it is written between its operands, its replacement).
_COMPARE_TOKENS: dict[type[ast.cmpop], tuple[str, str]] = {
    ast.Lt: (r"<(?!=)", "<="),
    ast.LtE: (r"<=", "<"),
    ast.Gt: (r">(?!=)", ">="),
    ast.GtE: (r">=", ">"),
    ast.Eq: (r"==", "!="),
    ast.NotEq: (r"!=", "=="),
    ast.Is: (r"\bis\b(?!\s+not\b)", "is not"),
    ast.IsNot: (r"\bis\s+not\b", "is"),
    ast.In: (r"(?<!not )\bin\b", "not in"),
    ast.NotIn: (r"\bnot\s+in\b", "in"),
}
# Negating `a == b` gives `a != b`, which flip-compare already makes.
_SELF_NEGATING = (ast.Eq, ast.NotEq, ast.Is, ast.IsNot, ast.In, ast.NotIn)
# Subscripts of these are type expressions, not indexing.
_GENERIC_TYPES = frozenset({"list", "dict", "tuple", "set", "frozenset", "type"})
_DEFINITIONS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class Mutation:
    """One change to a source file: bytes ``start:end`` replaced by ``replacement``.

    ``first_line``/``last_line`` (1-based) are the lines whose text identifies the mutant
    (``mutation_ids.py``): those of the node it changes, or of the parameter it ignores.
    """

    operator: str
    qualname: str
    start: int
    end: int
    replacement: bytes
    first_line: int
    last_line: int
    description: str

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement + source[self.end :]


@dataclass(frozen=True)
class _Scope:
    """The function (or class) being walked, and the ``*_dtype`` names it binds (what a
    plain dtype variable may be swapped with)."""

    qualname: str
    local_dtypes: tuple[str, ...] = ()


class _Source:
    """Byte offsets of the tree's positions (``ast`` columns are UTF-8 byte offsets)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._line_starts = [0] + [i + 1 for i, byte in enumerate(data) if byte == 0x0A]

    def offset(self, line: int, col: int) -> int:
        return self._line_starts[line - 1] + col

    def start(self, node: ast.AST) -> int:
        return self.offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self.offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def span(self, node: ast.AST) -> tuple[int, int]:
        return self.start(node), self.end(node)

    def text(self, node: ast.AST) -> str:
        return self.data[self.start(node) : self.end(node)].decode()

    def between(self, left: ast.AST, right: ast.AST) -> tuple[int, str]:
        """The offset and text between the end of ``left`` and the start of ``right``."""
        begin = self.end(left)
        return begin, self.data[begin : self.start(right)].decode()

    def line(self, node: ast.AST) -> str:
        """The first source line of ``node``, stripped: context for a description."""
        start = self._line_starts[node.lineno - 1]  # type: ignore[attr-defined]
        return self.data[start:].split(b"\n", 1)[0].decode().strip()

    def indentation(self, line: int) -> str:
        text = self.data[self._line_starts[line - 1] :].split(b"\n", 1)[0].decode()
        return text[: len(text) - len(text.lstrip())]


class _Collector:
    """Walks a module and records each mutation its operators make."""

    def __init__(self, source: _Source, dtype_attributes: dict[str, list[str]]) -> None:
        self.src = source
        self.dtype_attributes = dtype_attributes
        self.found: list[Mutation] = []

    def add(
        self,
        operator: str,
        scope: _Scope,
        span: tuple[int, int],
        replacement: str,
        anchor: ast.AST,
        description: str,
    ) -> None:
        """Record a mutation; ``anchor`` is the node whose lines identify it."""
        self.found.append(
            Mutation(
                operator=operator,
                qualname=scope.qualname,
                start=span[0],
                end=span[1],
                replacement=replacement.encode(),
                first_line=anchor.lineno,  # type: ignore[attr-defined]
                last_line=anchor.end_lineno,  # type: ignore[attr-defined]
                description=description,
            )
        )

    # --- the walk ------------------------------------------------------------------------

    def module(self, tree: ast.Module) -> None:
        for statement in tree.body:
            if isinstance(statement, _DEFINITIONS):
                self.definition(statement, "")

    def definition(self, node: ast.stmt, prefix: str) -> None:
        assert isinstance(node, _DEFINITIONS)
        qualname = f"{prefix}{node.name}"
        if isinstance(node, ast.ClassDef):
            self.block(node.body, _Scope(qualname), in_class=True)
            return
        scope = _Scope(qualname, _local_dtype_names(node))
        self.ignore_param(node, scope)
        for default in [*node.args.defaults, *node.args.kw_defaults]:
            if default is not None:
                self.expression(default, scope)
        self.block(node.body, scope, in_class=False)

    def block(self, body: list[ast.stmt], scope: _Scope, in_class: bool) -> None:
        for statement in body:
            self.statement(statement, scope, in_class)
        if not in_class:
            self.swap_statements(body, scope)

    def statement(self, node: ast.stmt, scope: _Scope, in_class: bool) -> None:
        if isinstance(node, _DEFINITIONS):
            self.definition(node, f"{scope.qualname}.")
            return
        if _never_mutated(node) or _ACCELERATOR_ONLY.search(self.header(node)):
            return
        if in_class:
            # Class bodies: only the values of fields (a policy's defaults).
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                self.expression(node.value, scope)
            return
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
            self.drop_statement(node, scope)
        if isinstance(node, ast.If | ast.While):
            self.negate(node.test, scope)
        for name, value in ast.iter_fields(node):
            if name in {"body", "orelse", "finalbody", "handlers", "annotation"}:
                continue
            for child in value if isinstance(value, list) else [value]:
                if isinstance(child, ast.expr):
                    self.expression(child, scope)
                elif isinstance(child, ast.withitem):
                    self.expression(child.context_expr, scope)
        for name in ("body", "orelse", "finalbody"):
            self.block(getattr(node, name, []), scope, in_class=False)
        for handler in getattr(node, "handlers", []):
            self.block(handler.body, scope, in_class=False)

    def header(self, node: ast.stmt) -> str:
        """A statement's own text: a compound statement's up to its first nested statement."""
        nested = [c for name in ("body", "orelse", "finalbody") for c in getattr(node, name, [])]
        if not nested:
            return self.src.text(node)
        return self.src.data[self.src.start(node) : self.src.start(nested[0])].decode()

    def expression(self, node: ast.expr, scope: _Scope) -> None:
        for child in _walk_expression(node):
            for operator in _EXPRESSION_OPERATORS:
                operator(self, child, scope)

    # --- statement operators -------------------------------------------------------------

    def drop_statement(self, node: ast.Expr, scope: _Scope) -> None:
        assert isinstance(node.value, ast.Call)
        name = _called_name(node.value)
        if name is not None and _HOOK_CALL.match(name):
            operator = "skip-hook"
        elif name in _WAIT_CALLS:
            operator = "remove-wait"
        else:
            operator = "drop-call"
        text = _short(self.src.text(node))
        self.add(operator, scope, self.src.span(node), "pass", node, f"`{text}` -> `pass`")

    def ignore_param(self, node: ast.FunctionDef | ast.AsyncFunctionDef, scope: _Scope) -> None:
        body = node.body[1:] if _is_docstring(node.body[0]) else node.body
        if not body or body[0].lineno == node.lineno:
            return  # nothing to insert before, or a one-line function
        arguments = node.args
        positional = [*arguments.posonlyargs, *arguments.args]
        with_defaults = list(
            zip(
                positional[len(positional) - len(arguments.defaults) :],
                arguments.defaults,
                strict=True,
            )
        )
        with_defaults += [
            (arg, default)
            for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
            if default is not None
        ]
        first = body[0]
        where = self.src.start(first)
        indent = self.src.indentation(first.lineno)
        read = _loaded_names(node)
        for arg, default in with_defaults:
            if arg.arg not in read:
                continue  # a parameter the body never reads: ignoring it changes nothing
            value = self.src.text(default)
            self.add(
                "ignore-param",
                scope,
                (where, where),
                f"{arg.arg} = {value}\n{indent}",
                arg,
                f"`{arg.arg}` ignored: `{arg.arg} = {_short(value)}` on entry",
            )

    def negate(self, test: ast.expr, scope: _Scope) -> None:
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            return  # removing the `not` is the same mutant
        if (
            isinstance(test, ast.Compare)
            and len(test.ops) == 1
            and isinstance(test.ops[0], _SELF_NEGATING)
        ):
            return
        text = self.src.text(test)
        self.add(
            "flip-bool",
            scope,
            self.src.span(test),
            f"not ({text})",
            test,
            f"condition `{_short(text)}` negated",
        )

    def swap_statements(self, body: list[ast.stmt], scope: _Scope) -> None:
        for first, second in itertools.pairwise(body):
            if not (_swappable(first) and _swappable(second)):
                continue
            if not (_has_effect(first) or _has_effect(second)):
                continue  # two assignments: their order matters only through a call
            if _assigned_names(first) & _loaded_names(second):
                continue  # the swap reads a name before it is bound: an error, not a schedule
            if any(_ACCELERATOR_ONLY.search(self.header(s)) for s in (first, second)):
                continue
            a, b = self.src.text(first), self.src.text(second)
            if a == b:
                continue
            _, gap = self.src.between(first, second)
            self.found.append(
                Mutation(
                    operator="swap-statements",
                    qualname=scope.qualname,
                    start=self.src.start(first),
                    end=self.src.end(second),
                    replacement=f"{b}{gap}{a}".encode(),
                    first_line=first.lineno,
                    last_line=second.end_lineno or second.lineno,
                    description=f"`{_short(a, 40)}` and `{_short(b, 40)}` swapped",
                )
            )


# --- expression operators: each takes the collector, one expression and its scope -----------


def _flip_bool(c: _Collector, node: ast.expr, scope: _Scope) -> None:
    if isinstance(node, ast.Constant) and isinstance(node.value, bool):
        flipped = str(not node.value)
        description = f"`{node.value}` -> `{flipped}` in `{_short(c.src.line(node))}`"
        c.add("flip-bool", scope, c.src.span(node), flipped, node, description)
    elif isinstance(node, ast.BoolOp):
        word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        for left, right in zip(node.values, node.values[1:], strict=False):
            begin, gap = c.src.between(left, right)
            found = re.search(rf"\b{word}\b", gap)
            if found is not None:
                span = (begin + found.start(), begin + found.end())
                description = f"`{word}` -> `{other}` in `{_short(c.src.text(node))}`"
                c.add("flip-bool", scope, span, other, node, description)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        # Parenthesised: `not a or b` must not become `a or b` inside a larger expression.
        operand = f"({c.src.text(node.operand)})"
        description = f"`not` removed from `{_short(c.src.text(node))}`"
        c.add("flip-bool", scope, c.src.span(node), operand, node, description)
    elif isinstance(node, ast.IfExp):
        c.negate(node.test, scope)


def _flip_compare(c: _Collector, node: ast.expr, scope: _Scope) -> None:
    if not isinstance(node, ast.Compare):
        return
    operands = [node.left, *node.comparators]
    for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
        pattern, replacement = _COMPARE_TOKENS[type(op)]
        begin, gap = c.src.between(left, right)
        found = re.search(pattern, gap)
        if found is not None:
            span = (begin + found.start(), begin + found.end())
            description = f"`{found.group()}` -> `{replacement}` in `{_short(c.src.text(node))}`"
            c.add("flip-compare", scope, span, replacement, node, description)


def _drop_kwarg(c: _Collector, node: ast.expr, scope: _Scope) -> None:
    if not isinstance(node, ast.Call):
        return
    elements: list[ast.AST] = sorted([*node.args, *node.keywords], key=c.src.start)
    for index, element in enumerate(elements):
        if not isinstance(element, ast.keyword) or element.arg in {None, *_INERT_KEYWORDS}:
            continue
        # The keyword and one separating comma go.
        if index + 1 < len(elements):
            span = (c.src.start(element), c.src.start(elements[index + 1]))
        elif index > 0:
            span = (c.src.end(elements[index - 1]), c.src.end(element))
        else:
            span = c.src.span(element)
        callee = _short(c.src.text(node.func))
        description = f"`{_short(c.src.text(element))}` left out of `{callee}(...)`"
        c.add("drop-kwarg", scope, span, "", node, description)


def _off_by_one(c: _Collector, node: ast.expr, scope: _Scope) -> None:
    if isinstance(node, ast.Subscript):
        where = f"`{_short(c.src.text(node))}`:"
        if isinstance(node.slice, ast.Slice):
            for bound in (node.slice.lower, node.slice.upper):
                if bound is not None:
                    _plus_minus_one(c, bound, scope, f"slice bound of {where}")
        elif _is_index(node.slice) and not _is_generic_type(node.value):
            _plus_minus_one(c, node.slice, scope, f"index of {where}")
    elif isinstance(node, ast.Call):
        name = _called_name(node) or ""
        positions = {"narrow": (1, 2), "range": (len(node.args) - 1,)}.get(name, ())
        for position in positions:
            if 0 <= position < len(node.args):
                _plus_minus_one(c, node.args[position], scope, f"argument of `{name}`:")
        if name in {"ceil", "floor"} and isinstance(node.func, ast.Attribute):
            other = "floor" if name == "ceil" else "ceil"
            span = (c.src.end(node.func.value), c.src.end(node.func))
            description = f"`{name}` -> `{other}` in `{_short(c.src.text(node))}`"
            c.add("off-by-one", scope, span, f".{other}", node, description)


def _plus_minus_one(c: _Collector, node: ast.expr, scope: _Scope, what: str) -> None:
    text = c.src.text(node)
    if _is_int(node):
        variants = [str(node.value + 1), str(node.value - 1)]  # type: ignore[attr-defined]
    elif (
        isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Add | ast.Sub)
        and _is_int(node.right)
    ):
        # `i + 1` becomes `i` and `i + 2`, not `(i + 1) + 1`.
        sign = 1 if isinstance(node.op, ast.Add) else -1
        base = c.src.text(node.left)
        variants = []
        for delta in (1, -1):
            total = sign * node.right.value + delta  # type: ignore[attr-defined]
            operator = "+" if total > 0 else "-"
            variants.append(base if total == 0 else f"{base} {operator} {abs(total)}")
    else:
        simple = isinstance(node, ast.Name | ast.Attribute | ast.Call | ast.Subscript)
        wrapped = text if simple else f"({text})"
        variants = [f"{wrapped} + 1", f"{wrapped} - 1"]
    for variant in variants:
        description = f"{what} `{_short(text)}` -> `{_short(variant)}`"
        c.add("off-by-one", scope, c.src.span(node), variant, node, description)


def _swap_dtype(c: _Collector, node: ast.expr, scope: _Scope) -> None:
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
        and node.attr in _DTYPE_SWAPS
    ):
        other = _DTYPE_SWAPS[node.attr]
        description = f"`torch.{node.attr}` -> `torch.{other}` in `{_short(c.src.line(node))}`"
        c.add("swap-dtype", scope, c.src.span(node), f"torch.{other}", node, description)
        return
    candidates: Sequence[str]
    if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
        name, prefix = node.attr, c.src.text(node.value) + "."
        candidates = c.dtype_attributes.get(prefix, ())
    elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
        name, prefix, candidates = node.id, "", scope.local_dtypes
    else:
        return
    if not name.endswith("_dtype"):
        return
    for other in candidates:
        if other != name:
            description = f"`{prefix}{name}` -> `{prefix}{other}`"
            c.add("swap-dtype", scope, c.src.span(node), f"{prefix}{other}", node, description)


_EXPRESSION_OPERATORS: tuple[Callable[[_Collector, ast.expr, _Scope], None], ...] = (
    _flip_bool,
    _flip_compare,
    _drop_kwarg,
    _off_by_one,
    _swap_dtype,
)


# --- the entry point ---------------------------------------------------------------------------


def mutations_of(source: str | bytes) -> list[Mutation]:
    """Every mutation of one module's source, in source order."""
    data = source.encode() if isinstance(source, str) else source
    tree = ast.parse(data)
    src = _Source(data)
    collector = _Collector(src, _dtype_attributes(tree, src))
    collector.module(tree)
    return sorted(collector.found, key=lambda m: (m.start, m.end, m.operator, m.replacement))


def _dtype_attributes(tree: ast.Module, src: _Source) -> dict[str, list[str]]:
    """The ``*_dtype`` attributes a module reads, by receiver (``"self."``, ``"mp_policy."``):
    a swapped dtype is another one the same object has."""
    names: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.endswith("_dtype"):
            names.setdefault(src.text(node.value) + ".", set()).add(node.attr)
    return {prefix: sorted(found) for prefix, found in names.items()}


def _local_dtype_names(node: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple[str, ...]:
    """The ``*_dtype`` parameters and variables a function binds."""
    arguments = node.args
    names = {
        arg.arg
        for arg in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
        if arg.arg.endswith("_dtype")
    }
    names |= {name for name in _assigned_names(node) if name.endswith("_dtype")}
    return tuple(sorted(names))


# --- small predicates --------------------------------------------------------------------------


def _walk_expression(node: ast.expr) -> Iterator[ast.expr]:
    """``node`` and its sub-expressions, f-strings (messages) left out."""
    if isinstance(node, ast.JoinedStr):
        return
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.expr):
            yield from _walk_expression(child)
        elif isinstance(child, ast.keyword):
            yield from _walk_expression(child.value)
        elif isinstance(child, ast.comprehension):
            for part in (child.iter, *child.ifs):
                yield from _walk_expression(part)


def _never_mutated(node: ast.stmt) -> bool:
    if isinstance(
        node, ast.Assert | ast.Raise | ast.Import | ast.ImportFrom | ast.Global | ast.Nonlocal
    ):
        return True
    if _is_docstring(node):
        return True
    if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
        return True
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
    return False


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _is_int(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int)
        and not isinstance(node.value, bool)
    )


def _called_name(call: ast.Call) -> str | None:
    func = call.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _is_index(node: ast.expr) -> bool:
    """An integer-valued index: a number, a variable or arithmetic, not a key or a type."""
    if isinstance(node, ast.Constant):
        return _is_int(node)
    if isinstance(node, ast.Name | ast.Attribute):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return not name[:1].isupper()
    return isinstance(node, ast.BinOp | ast.UnaryOp)


def _is_generic_type(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in _GENERIC_TYPES or node.id[:1].isupper()
    return isinstance(node, ast.Attribute) and node.attr[:1].isupper()


def _swappable(node: ast.stmt) -> bool:
    skipped = (*_DEFINITIONS, ast.Return, ast.Pass, ast.Break, ast.Continue)
    return not (_never_mutated(node) or isinstance(node, skipped))


def _has_effect(node: ast.stmt) -> bool:
    """A call made for its effect: a call statement, or a block that holds one."""
    return any(
        isinstance(child, ast.Expr) and isinstance(child.value, ast.Call)
        for child in ast.walk(node)
    )


def _assigned_names(node: ast.AST) -> set[str]:
    return {
        child.id
        for child in ast.walk(node)
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)
    }


def _loaded_names(node: ast.AST) -> set[str]:
    return {
        child.id
        for child in ast.walk(node)
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load)
    }


def _short(text: str, limit: int = 60) -> str:
    """``text`` on one line for a description: whitespace collapsed, long text cut."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
