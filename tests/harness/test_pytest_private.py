"""The audited private-pytest accessors work on the pinned pytest and say so loudly on
any other version (ranks then fall back to plain assertion messages)."""

from __future__ import annotations

import pytest

from distconform.harness import _pytest_private


def test_the_installed_pytest_is_audited():
    assert _pytest_private.audit_problem() is None, _pytest_private.audit_problem()


@pytest.mark.parametrize("version", ["9.3.0", "8.4.2", "10.0.0rc1"])
def test_an_unaudited_pytest_turns_rank_rewriting_off_and_says_why(
    monkeypatch, pytestconfig, version
):
    monkeypatch.setattr(pytest, "__version__", version)
    problem = _pytest_private.audit_problem()
    assert problem is not None and version in problem and "AUDITED_PYTEST" in problem
    assert _pytest_private.assertion_settings(pytestconfig) is None


def test_this_module_was_rewritten_by_pytest_and_a_plain_one_was_not():
    import json
    import sys

    assert _pytest_private.is_rewritten(sys.modules[__name__])
    assert not _pytest_private.is_rewritten(json)


def test_rewritten_code_explains_a_failed_comparison():
    source = b"def check(a, b):\n    assert a == b\n"
    namespace: dict = {}
    exec(_pytest_private.rewritten_code(source, "/virtual/check.py"), namespace)
    with pytest.raises(AssertionError) as excinfo:
        namespace["check"](3, 4)
    assert "assert 3 == 4" in str(excinfo.value)


def test_assert_plain_leaves_ranks_unrewritten(pytester):
    assert _pytest_private.assertion_settings(pytester.parseconfig("--assert=plain")) is None
    settings = _pytest_private.assertion_settings(pytester.parseconfig("-vv"))
    assert settings is not None and settings.verbosity == 2


def _write_pytest_pyc(source_path, code):
    """A checked-hash pyc (PEP 552) where pytest's import hook keeps rewritten code."""
    import importlib.util
    import marshal

    from _pytest.assertion.rewrite import PYC_TAIL

    header = (
        importlib.util.MAGIC_NUMBER
        + b"\x03\x00\x00\x00"
        + importlib.util.source_hash(source_path.read_bytes())
    )
    cache = source_path.parent / "__pycache__"
    cache.mkdir(exist_ok=True)
    (cache / (source_path.name[:-3] + PYC_TAIL)).write_bytes(header + marshal.dumps(code))


def test_ranks_reuse_the_rewritten_code_pytest_cached_while_the_source_is_unchanged(tmp_path):
    from distconform.harness.shared.rewritten_imports import _RewritingLoader

    source = tmp_path / "test_cached.py"
    source.write_text("ORIGIN = 'source'\n")
    _write_pytest_pyc(source, compile("ORIGIN = 'cache'\n", str(source), "exec"))
    namespace: dict = {}
    exec(_RewritingLoader("test_cached", str(source)).get_code("test_cached"), namespace)
    assert namespace["ORIGIN"] == "cache"

    source.write_text("ORIGIN = 'edited source'\n")  # the cache no longer matches
    assert _pytest_private.cached_rewritten_code(str(source)) is None
    namespace = {}
    exec(_RewritingLoader("test_cached", str(source)).get_code("test_cached"), namespace)
    assert namespace["ORIGIN"] == "edited source"


def test_an_unaudited_pytest_never_reads_its_cache(tmp_path, monkeypatch):
    source = tmp_path / "test_cached.py"
    source.write_text("ORIGIN = 'source'\n")
    _write_pytest_pyc(source, compile("ORIGIN = 'cache'\n", str(source), "exec"))
    assert _pytest_private.cached_rewritten_code(str(source)) is not None
    monkeypatch.setattr(pytest, "__version__", "9.3.0")
    assert _pytest_private.cached_rewritten_code(str(source)) is None


@pytest.mark.parametrize(
    ("version", "at_the_item"), [(pytest.__version__, True), ("99.0.0", False)]
)
def test_a_harness_skip_is_reported_at_the_items_line_on_an_audited_pytest(
    monkeypatch, version, at_the_item
):
    monkeypatch.setattr(pytest, "__version__", version)
    with pytest.raises(pytest.skip.Exception) as excinfo:
        _pytest_private.skip_at_the_items_location("needs two GPUs")
    assert excinfo.value.msg == "needs two GPUs"
    assert excinfo.value._use_item_location is at_the_item
