"""Point to point: send / recv, isend / irecv and batch_isend_irecv around a ring and back,
with tags keeping two messages between the same pair apart."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distconform.suites.backend.collectives import dtype_grid
from distconform.suites.backend.contributions import SIZES, contribution, pair_salt
from distconform.suites.backend.oracle import Findings, unlike
from distconform.suites.cases import conformance


def _message(src: int, dst: int, numel: int, dtype: str, salt: int, device) -> torch.Tensor:
    return contribution(src, numel, dtype, salt=salt + pair_salt(dst), device=device)


@conformance("backend.send_recv")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_send_recv_ring(dtype: str, rank_ctx) -> None:
    """Blocking send/recv to the next rank (even ranks send first, so no two block on each
    other), then two tagged isends to the next rank, received in the reverse tag order."""
    findings = Findings(f"send/recv {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    right, left = (rank + 1) % world, (rank - 1) % world
    for salt, numel in enumerate(SIZES):
        where = f"{numel} elements"
        outgoing = _message(rank, right, numel, dtype, salt, device)
        incoming = unlike(_message(left, rank, numel, dtype, salt, device))
        if rank % 2 == 0:
            dist.send(outgoing, dst=right)
            dist.recv(incoming, src=left)
        else:
            dist.recv(incoming, src=left)
            dist.send(outgoing, dst=right)
        findings.expect_equal(incoming, _message(left, rank, numel, dtype, salt, device), where)

        # Two messages to the same peer, received in the opposite order of their tags: only
        # a backend that matches by tag, not by arrival, delivers each to its own buffer.
        works = [
            dist.isend(
                _message(rank, right, numel, dtype, salt + tag, device),
                dst=right,
                tag=tag,
            )
            for tag in (1, 2)
        ]
        received = {
            tag: unlike(_message(left, rank, numel, dtype, salt + tag, device)) for tag in (2, 1)
        }
        works += [dist.irecv(buffer, src=left, tag=tag) for tag, buffer in received.items()]
        for work in works:
            work.wait()
        for tag, tensor in received.items():
            findings.expect_equal(
                tensor,
                _message(left, rank, numel, dtype, salt + tag, device),
                f"isend/irecv tag {tag} from {left}, {where}",
            )
    findings.raise_if_any()


@conformance("backend.batch_isend_irecv")
@pytest.mark.parametrize("dtype", dtype_grid())
def test_batch_isend_irecv_ring(dtype: str, rank_ctx) -> None:
    findings = Findings(f"batch_isend_irecv {dtype}")
    world, rank, device = rank_ctx.world_size, rank_ctx.rank, rank_ctx.device
    right, left = (rank + 1) % world, (rank - 1) % world
    for salt, numel in enumerate(SIZES):
        from_left = unlike(_message(left, rank, numel, dtype, salt, device))
        from_right = unlike(_message(right, rank, numel, dtype, salt, device))
        operations = [
            dist.P2POp(
                dist.isend,
                _message(rank, right, numel, dtype, salt, device),
                right,
            ),
            dist.P2POp(dist.isend, _message(rank, left, numel, dtype, salt, device), left),
            dist.P2POp(dist.irecv, from_left, left),
            dist.P2POp(dist.irecv, from_right, right),
        ]
        for work in dist.batch_isend_irecv(operations):
            work.wait()
        where = f"{numel} elements"
        findings.expect_equal(
            from_left, _message(left, rank, numel, dtype, salt, device), f"from left, {where}"
        )
        findings.expect_equal(
            from_right, _message(right, rank, numel, dtype, salt, device), f"from right, {where}"
        )
    findings.raise_if_any()
