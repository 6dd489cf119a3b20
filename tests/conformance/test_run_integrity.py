"""A conformance report never reads as a finished run when the run was not one, and a bad
command line is refused before any test runs (one line, no traceback, no report).

The runs here are tiny local tests (no ranks): what is checked is the plugin's bookkeeping.
"""

from __future__ import annotations

import json

import pytest

from distconform.conformance.progress import STILL_RUNNING
from tests.conformance.report_checks import check_report_dir

THREE_TESTS = """
import json, pathlib

def test_first():
    pass

def test_second():
    {second}

def test_third():
    pass
"""


def run(pytester, second: str, *options: str, subprocess: bool = False):
    pytester.makepyfile(test_three=THREE_TESTS.format(second=second))
    runpytest = pytester.runpytest_subprocess if subprocess else pytester.runpytest
    result = runpytest("-p", "no:cacheprovider", "--conformance-out", "out", *options)
    return result, check_report_dir(pytester.path / "out")


def test_a_full_run_is_complete(pytester):
    result, report = run(pytester, "assert 1 == 2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert report["complete"] is True and report["exit_status"] == "TESTS_FAILED"
    assert report["stopped_because"] is None and report["tests_expected"] == 3
    assert "INCOMPLETE" not in result.stdout.str()


def test_a_run_stopped_by_x_says_so_everywhere(pytester):
    result, report = run(pytester, "assert 1 == 2", "-x")
    assert report["complete"] is False
    assert report["exit_status"] == "TESTS_FAILED"
    assert report["stopped_because"] == "stopping after 1 failures"
    assert (report["tests_expected"], report["summary"]["tests"]) == (3, 2)
    headline = "INCOMPLETE: stopping after 1 failures; 2 of 3 tests reported"
    assert headline in result.stdout.str()
    markdown = (pytester.path / "out" / "conformance.md").read_text()
    assert f"**{headline}" in markdown.splitlines()[2]


def test_an_interrupted_run_leaves_the_cut_test_out(pytester):
    # In a child: in this process the interrupt would stop the session running this test.
    result, report = run(pytester, "raise KeyboardInterrupt", subprocess=True)
    assert result.ret == pytest.ExitCode.INTERRUPTED
    assert report["complete"] is False and report["exit_status"] == "INTERRUPTED"
    assert report["stopped_because"] == "interrupted (KeyboardInterrupt)"
    assert report["tests_cut_short"] == 1
    assert [t["nodeid"].split("::")[1] for t in report["tests"]] == ["test_first"]


def test_the_report_on_disk_says_unfinished_while_the_run_goes_on(pytester):
    # The second test reads the report as a killed run would leave it.
    second = (
        "pathlib.Path('seen.json').write_text(pathlib.Path('out/conformance.json').read_text())"
    )
    result, final = run(pytester, second, "--conformance-progress", "0.000001")
    assert final["complete"] is True
    seen = json.loads((pytester.path / "seen.json").read_text())
    assert seen["complete"] is False and seen["exit_status"] is None
    assert seen["stopped_because"] == STILL_RUNNING
    assert [t["nodeid"].split("::")[1] for t in seen["tests"]] == ["test_first"]
    result.stdout.fnmatch_lines(["conformance: 1/3 tests done (33 %), *s elapsed, about *s left"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--conformance-out", "afile"],
            "ERROR: --conformance-out afile is a file, not a directory: name a directory for "
            "the report",
        ),
        (["--conformance-out", "out", "--impl", "nonexistent"], "ERROR: --impl nonexistent: "),
        (
            ["--conformance-out", "out", "--impl", "os:path"],
            "ERROR: --impl os:path: os:path is a module, not a factory: the name after ':' must "
            "be a function (or class) that returns a distconform.impl.api.Implementation",
        ),
        (
            ["--conformance-out", "out", "--world-sizes", "3"],
            "ERROR: --world-sizes 3 selects none of the 2 distributed tests collected; their "
            "world sizes are 1, 2",
        ),
    ],
    ids=["out-is-a-file", "impl-missing", "impl-not-callable", "no-such-world-size"],
)
def test_a_bad_command_line_is_one_line_before_any_test(pytester, options, message):
    pytester.makepyfile(
        test_dist="""
        import pytest

        @pytest.mark.world_size(1, 2)
        def test_needs_ranks(rank_ctx):
            raise AssertionError("must not run")
        """
    )
    (pytester.path / "afile").write_text("not a directory")
    result = pytester.runpytest("-p", "no:cacheprovider", *options)
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.USAGE_ERROR, output
    assert message in output
    assert "Traceback" not in output and "must not run" not in output
    assert "report written" not in output
    assert not (pytester.path / "out").exists(), "a refused run leaves no report directory"


def test_the_cli_refuses_an_unwritable_out_in_its_own_words(tmp_path, capsys):
    from distconform.conformance.cli import main

    blocked = tmp_path / "afile"
    blocked.write_text("")
    assert main(["--out", str(blocked)]) == pytest.ExitCode.USAGE_ERROR
    assert capsys.readouterr().err == (
        f"ERROR: --out {blocked} is a file, not a directory: name a directory for the report\n"
    )


def test_plain_tests_run_with_the_harness_plugin_turned_off(pytester):
    # The conformance plugin implements the harness's hooks: with the harness off it stays
    # out of the way instead of failing pytest's hook validation.
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "no:distconform")
    result.assert_outcomes(passed=1)
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
