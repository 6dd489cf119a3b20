"""Everything that runs inside a rank, whichever launcher started it.

A rank (a worker process, a thread of the thread host, or a torchrun process) receives a
:class:`harness.shared.task.RankTask` and hands it to :func:`harness.rank.execute.run_task`, which
builds the :class:`~harness.shared.rank_context.RankContext`, applies the memory limit, the warning
filters and the device audit, runs the test body and checks what it left behind
(:mod:`harness.rank.hygiene`). Nothing here imports the parent's side (pools, pytest hooks,
reports): what crosses back is a :class:`harness.shared.outcomes.RankResult`.
"""
