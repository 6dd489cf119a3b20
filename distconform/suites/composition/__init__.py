"""Composition suites: pipeline schedules, distributed checkpoints and tensor parallel.

The upstream cases that compose FSDP2 or replicate with another torch feature, written
against ``distconform.impl.api`` with the real engines
(``torch.distributed.pipelining``, ``torch.distributed.checkpoint``,
``torch.distributed.tensor.parallel``). Items whose implementation lacks a capability are
skipped at collection with a reason starting ``UNSUPPORTED: needs capability``.
"""
