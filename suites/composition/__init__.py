"""Composition suites: pipeline schedules, distributed checkpoints and tensor parallel.

cases.md §2.10, §2.11, §3.9 and §4, written against ``impl.api`` with the real engines
(``torch.distributed.pipelining``, ``torch.distributed.checkpoint``,
``torch.distributed.tensor.parallel``). Items whose implementation lacks a capability are
skipped at collection with a reason starting ``UNSUPPORTED: needs capability``.
"""
