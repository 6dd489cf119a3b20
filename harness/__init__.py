"""distconform's harness: run a function or a pytest test on N ranks and report honestly.

Public API:

- ``@pytest.mark.world_size(2, 4)`` and the ``rank_ctx`` fixture (the pytest plugin);
- :func:`run_on_ranks` / :func:`launch` for code that is not a test;
- :func:`get_rank_context` inside a function running on a rank;
- :class:`RankLocal` for fixtures whose value must be built inside each rank.
"""

from harness.api import launch, run_on_ranks
from harness.config import ConfigError
from harness.outcomes import Outcome, RankResult, RunResult
from harness.rank_context import RankContext, RankLocal, get_rank_context
from harness.report import DistributedFailure

__all__ = [
    "ConfigError",
    "DistributedFailure",
    "Outcome",
    "RankContext",
    "RankLocal",
    "RankResult",
    "RunResult",
    "get_rank_context",
    "launch",
    "run_on_ranks",
]
