"""Everything that runs inside a rank, whichever launcher started it.

A rank (a worker process, a thread of the thread host, or a torchrun process) receives a
:class:`distconform.harness.shared.task.RankTask` and hands it to
:func:`distconform.harness.rank.execute.run_task`, which builds the
:class:`~distconform.harness.shared.rank_context.RankContext`, applies the memory limit, the warning
filters and the device audit, runs the test body and checks what it left behind
(:mod:`distconform.harness.rank.hygiene`). Nothing here imports the parent's side (pools, pytest
hooks, reports): what crosses back is a :class:`distconform.harness.shared.outcomes.RankResult`.
"""
