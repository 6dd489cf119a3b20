"""pytest's warning filters apply inside the ranks; rank warnings reach the summary."""

from __future__ import annotations

import textwrap


def test_ini_filters_turn_our_futurewarnings_into_failures_in_the_ranks(pytester):
    pytester.makeini(
        """
        [pytest]
        filterwarnings =
            error::FutureWarning:ourcode.*
        """
    )
    pytester.mkpydir("ourcode")
    pytester.path.joinpath("ourcode", "api.py").write_text(
        textwrap.dedent(
            """
            import warnings

            def deprecated_call():
                warnings.warn("ourcode calls a deprecated API", FutureWarning)
            """
        )
    )
    pytester.makepyfile(
        test_filters="""
        import warnings
        import pytest
        from ourcode.api import deprecated_call

        @pytest.mark.world_size(2)
        def test_our_code_warns(rank_ctx):
            deprecated_call()

        @pytest.mark.world_size(2)
        def test_other_code_warns(rank_ctx):
            warnings.warn(f"rank {rank_ctx.rank} says hello", UserWarning)
            warnings.warn("every rank says this", FutureWarning)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1, passed=1, warnings=3)
    result.stdout.fnmatch_lines(
        [
            "*rank [01] failed: FutureWarning: ourcode calls a deprecated API*",
            "*UserWarning: [[]rank 0[]] rank 0 says hello*",
            "*FutureWarning: [[]rank 0, 1[]] every rank says this*",
        ]
    )
