"""Marker arguments are checked at collection: a mistake is one line naming the test and the
fix, before any rank starts (no IndexError from inside the harness, no traceback)."""

from __future__ import annotations

import pytest

from distconform.harness.controller.config import ConfigError
from distconform.harness.controller.markers import (
    deadline_of,
    memory_limit_of,
    required_devices_of,
    world_sizes_of,
)


@pytest.mark.parametrize(
    ("read", "mark", "complaint"),
    [
        (deadline_of, pytest.mark.deadline(), "takes one argument"),
        (deadline_of, pytest.mark.deadline("5"), "positive number of seconds, got '5'"),
        (deadline_of, pytest.mark.deadline(0), "positive number of seconds, got 0"),
        (deadline_of, pytest.mark.deadline(True), "positive number of seconds, got True"),
        (required_devices_of, pytest.mark.requires_devices(), "takes one argument"),
        (required_devices_of, pytest.mark.requires_devices("x"), "got 'x'"),
        (required_devices_of, pytest.mark.requires_devices(1.5), "got 1.5"),
        (memory_limit_of, pytest.mark.memory_limit(), "takes one argument"),
        (world_sizes_of, pytest.mark.world_size(2, 2), "lists 2 more than once"),
        (world_sizes_of, pytest.mark.world_size("2"), "positive integer, got '2'"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(read, mark, complaint):
    with pytest.raises(ConfigError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        read(mark.mark)


def test_good_arguments_are_read():
    assert deadline_of(pytest.mark.deadline(2.5).mark) == 2.5
    assert required_devices_of(pytest.mark.requires_devices(4).mark) == 4
    assert world_sizes_of(pytest.mark.world_size(1, 2, 4).mark) == [1, 2, 4]
    assert world_sizes_of(pytest.mark.world_size([2, 3]).mark) == [2, 3]


def test_a_bad_marker_stops_the_run_at_collection_with_one_line(pytester):
    pytester.makepyfile(
        test_bad="""
        import pytest

        @pytest.mark.world_size(2)
        @pytest.mark.deadline()
        def test_no_seconds(rank_ctx):
            pass
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    output = result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED, output
    assert (
        "test_bad.py::test_no_seconds: @pytest.mark.deadline takes one argument, e.g. "
        "@pytest.mark.deadline(120); got deadline()"
    ) in output
    assert "Traceback" not in output and "IndexError" not in output
    assert "passed" not in output
