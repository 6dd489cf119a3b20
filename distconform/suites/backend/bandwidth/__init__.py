"""``python -m distconform bench-collectives``: time and bandwidth of a c10d backend's collectives.

For each collective, world size and message size it measures the time of one call and the
two bandwidths nccl-tests reports (``doc/PERFORMANCE.md`` in NVIDIA/nccl-tests):

- ``S``, the size, is the full buffer: the all-reduced or broadcast tensor, the gathered
  output of all_gather, the input of reduce_scatter, the whole send buffer of all_to_all;
- ``algbw = S / t``;
- ``busbw = algbw * factor``, the factor being ``2(n-1)/n`` for all_reduce, ``(n-1)/n`` for
  all_gather, reduce_scatter and all_to_all, ``1`` for broadcast and reduce. It undoes the
  part of ``algbw`` that falls as ranks are added, so busbw is comparable across world
  sizes and with a link's peak bandwidth.

``t`` is the time of one call on the slowest rank: each rank times ``iters`` calls after a
barrier (and a device synchronisation off the CPU) and the maximum of the ranks' means is
reported, since a collective is done only when its last rank is done. nccl-tests averages
over ranks by default (its ``-a 3`` takes the maximum); every rank's mean is kept in the
JSON records, so either can be derived.

Why: a conformance pass says a backend computes the right values, not that it is fast
enough to train with. A vendor's absolute numbers mean little on their own, so unless
``--no-peer`` is given (or the backend is gloo) the same sizes and world sizes are also
measured with gloo on CPU process ranks in the same run, interleaved op by op, and the table
shows both side by side.

Reading order: ``arithmetic``, ``measure`` (ranks, then parent), ``output``, ``cli``.
"""

from __future__ import annotations

from distconform.suites.backend.bandwidth.cli import main

__all__ = ["main"]
