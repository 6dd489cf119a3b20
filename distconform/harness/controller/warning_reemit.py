"""The ranks' warnings back in pytest.

Most of a distributed test runs in the ranks, out of reach of pytest's warning capture.
The parent ships its filters (ini ``filterwarnings`` and ``-W``, read once into the run's
settings by :mod:`distconform.harness.controller.run_options`) with each task; the rank applies them
(so ``error::FutureWarning:impl.*`` fails a test whose rank calls a deprecated API) and
records what was not turned into an error (:mod:`distconform.harness.rank.warning_capture`). Here
the parent re-emits those warnings, prefixed with the rank, inside the test, where pytest's warnings
summary shows them.
"""

from __future__ import annotations

import warnings

from distconform.harness.shared.rank_warnings import RankWarning, category_of


def reemit(rank_warnings: dict[int, list[RankWarning]]) -> None:
    """Warn once per distinct warning, naming every rank that raised it."""
    ranks_of: dict[RankWarning, list[int]] = {}
    for rank, items in sorted(rank_warnings.items()):
        for item in items:
            ranks_of.setdefault(item, []).append(rank)
    for item, ranks in ranks_of.items():
        listed = ", ".join(str(r) for r in ranks)
        warnings.warn_explicit(
            f"[rank {listed}] {item.message}",
            category_of(item.category),
            item.filename,
            item.lineno,
        )
