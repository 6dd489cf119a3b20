"""pytest's warning filters for the ranks, and the ranks' warnings back in pytest.

Most of a distributed test runs in the ranks, out of reach of pytest's warning
capture. The parent ships its filters (ini ``filterwarnings`` and ``-W``) with each
task; the rank applies them (so ``error::FutureWarning:impl.*`` fails a test whose
rank calls a deprecated API) and records what was not turned into an error. The
parent re-emits those warnings, prefixed with the rank, inside the test, where
pytest's warnings summary shows them. The rank's half is
:mod:`harness.rank.warning_capture`.
"""

from __future__ import annotations

import warnings

from harness.shared.rank_warnings import RankWarning, category_of


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


def filters_from_config(config) -> tuple[tuple[str, bool], ...]:
    """The ini ``filterwarnings`` lines, then ``-W`` options (later ones win).

    Each comes with whether its text is literal (command line) or a regex (ini).
    """
    ini = [(line.strip(), False) for line in config.getini("filterwarnings") if line.strip()]
    cli = [(line, True) for line in config.known_args_namespace.pythonwarnings or []]
    return (*ini, *cli)
