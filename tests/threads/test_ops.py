"""Every op of the threaded backend against closed-form values at world sizes 2, 3, 4 and 8.

Rank r contributes values derived from r + 1, so each expected result is a formula in the
world size (sums, products, rank-indexed chunks) rather than another backend's output.
Each rank body asserts on its own result and returns nothing: a wrong value on any rank
fails the test with that rank's traceback.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from distconform.harness import torch_api

WORLD_SIZES = (2, 3, 4, 8)
pytestmark = pytest.mark.parametrize("ws", WORLD_SIZES, ids=lambda ws: f"ws{ws}")


def _rank() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _eq(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# --- all_reduce --------------------------------------------------------------------------


def _all_reduce(op_name: str) -> None:
    r, ws = _rank()
    t = torch.full((5,), float(r + 1), dtype=torch.float64)
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
    expected = {
        "SUM": ws * (ws + 1) / 2,
        "AVG": (ws + 1) / 2,
        "MAX": ws,
        "MIN": 1,
        "PRODUCT": math.factorial(ws),
    }[op_name]
    _eq(t, torch.full((5,), float(expected), dtype=torch.float64))


@pytest.mark.parametrize("op_name", ["SUM", "AVG", "MAX", "MIN", "PRODUCT"])
def test_all_reduce(runners, ws, op_name):
    runners.run(ws, _all_reduce, op_name)


def _all_reduce_int_and_elementwise() -> None:
    r, ws = _rank()
    # Per-element different winners: element i is maximal on rank (i % ws).
    t = torch.tensor([(r - i) % ws for i in range(7)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _eq(t, torch.full((7,), ws - 1, dtype=torch.int64))
    b = torch.tensor([1 << r], dtype=torch.int64)
    dist.all_reduce(b, op=dist.ReduceOp.BOR)
    _eq(b, torch.tensor([(1 << ws) - 1]))


def test_all_reduce_int_elementwise(runners, ws):
    runners.run(ws, _all_reduce_int_and_elementwise)


def _reduce() -> None:
    r, ws = _rank()
    t = torch.full((3,), float(r + 1))
    dist.reduce(t, dst=ws - 1, op=dist.ReduceOp.SUM)
    expected = ws * (ws + 1) / 2 if r == ws - 1 else float(r + 1)
    _eq(t, torch.full((3,), expected))


def test_reduce(runners, ws):
    runners.run(ws, _reduce)


# --- broadcast, scatter, gather ---------------------------------------------------------


def _broadcast() -> None:
    r, ws = _rank()
    t = torch.full((2, 3), float(r + 1))
    dist.broadcast(t, src=ws - 1)
    _eq(t, torch.full((2, 3), float(ws)))


def test_broadcast(runners, ws):
    runners.run(ws, _broadcast)


def _scatter() -> None:
    r, ws = _rank()
    out = torch.zeros(2)
    pieces = [torch.full((2,), 10.0 * (j + 1)) for j in range(ws)] if r == 0 else None
    dist.scatter(out, pieces, src=0)
    _eq(out, torch.full((2,), 10.0 * (r + 1)))


def test_scatter(runners, ws):
    runners.run(ws, _scatter)


def _gather() -> None:
    r, ws = _rank()
    dst = ws - 1
    out = [torch.zeros(2) for _ in range(ws)] if r == dst else None
    dist.gather(torch.full((2,), float(r + 1)), out, dst=dst)
    if r == dst:
        for j, t in enumerate(out):
            _eq(t, torch.full((2,), float(j + 1)))


def test_gather(runners, ws):
    runners.run(ws, _gather)


# --- all_gather (list, uneven) and all_gather_single ----------------------------------


def _all_gather_uneven() -> None:
    r, ws = _rank()
    # Rank j contributes j + 1 elements: the total is not a multiple of the world size.
    out = [torch.zeros(j + 1) for j in range(ws)]
    dist.all_gather(out, torch.full((r + 1,), float(r + 1)))
    for j, t in enumerate(out):
        _eq(t, torch.full((j + 1,), float(j + 1)))


def test_all_gather_list_uneven(runners, ws):
    runners.run(ws, _all_gather_uneven)


def _all_gather_single() -> None:
    r, ws = _rank()
    out = torch.zeros(3 * ws)
    torch_api.all_gather_single(out, 10.0 * (r + 1) + torch.arange(3.0))
    _eq(out, torch.cat([10.0 * (j + 1) + torch.arange(3.0) for j in range(ws)]))
    stacked = torch.zeros(ws, 2, 2)  # the stacked output layout is allowed too
    torch_api.all_gather_single(stacked, torch.full((2, 2), float(r + 1)))
    _eq(stacked[:, 0, 0], torch.arange(1, ws + 1, dtype=torch.float32))


def test_all_gather_single(runners, ws):
    runners.run(ws, _all_gather_single)


def _all_gather_single_coalesced() -> None:
    r, ws = _rank()
    inputs = [torch.full((2,), float(r + 1)), torch.full((3,), float(-(r + 1)))]
    outputs = [torch.zeros(2 * ws), torch.zeros(3 * ws)]
    dist.group.WORLD.all_gather_single_coalesced(outputs, inputs).wait()
    ranks = torch.arange(1, ws + 1, dtype=torch.float32)
    _eq(outputs[0], ranks.repeat_interleave(2))
    _eq(outputs[1], -ranks.repeat_interleave(3))


def test_all_gather_single_coalesced(runners, ws):
    runners.run(ws, _all_gather_single_coalesced)


# --- reduce_scatter ------------------------------------------------------------------


def _reduce_scatter_single(op_name: str) -> None:
    r, ws = _rank()
    # Element i of rank r's input is (r + 1) * (i + 1); rank j keeps elements 2j, 2j + 1.
    inp = (r + 1) * torch.arange(1, 2 * ws + 1, dtype=torch.float64)
    out = torch.zeros(2, dtype=torch.float64)
    torch_api.reduce_scatter_single(out, inp, op=getattr(dist.ReduceOp, op_name))
    factor = ws * (ws + 1) / 2 if op_name == "SUM" else (ws + 1) / 2
    _eq(out, factor * torch.tensor([2 * r + 1, 2 * r + 2], dtype=torch.float64))


@pytest.mark.parametrize("op_name", ["SUM", "AVG"])
def test_reduce_scatter_single(runners, ws, op_name):
    runners.run(ws, _reduce_scatter_single, op_name)


def _reduce_scatter_list_uneven() -> None:
    r, ws = _rank()
    # Destination j receives j + 1 elements: sizes differ per rank, total not divisible.
    inputs = [torch.full((j + 1,), float(r + 1) + 100 * j) for j in range(ws)]
    out = torch.zeros(r + 1)
    dist.reduce_scatter(out, inputs, op=dist.ReduceOp.SUM)
    _eq(out, torch.full((r + 1,), ws * (ws + 1) / 2 + 100.0 * r * ws))


def test_reduce_scatter_list_uneven(runners, ws):
    runners.run(ws, _reduce_scatter_list_uneven)


def _reduce_scatter_single_coalesced(op_name: str) -> None:
    r, ws = _rank()
    inputs = [torch.full((ws,), float(r + 1)), torch.arange(2.0 * ws) * (r + 1)]
    outputs = [torch.zeros(1), torch.zeros(2)]
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = getattr(dist.ReduceOp, op_name)
    dist.group.WORLD.reduce_scatter_single_coalesced(outputs, inputs, opts).wait()
    total = ws * (ws + 1) / 2
    scale = total if op_name == "SUM" else total / ws
    _eq(outputs[0], torch.tensor([scale]))
    _eq(outputs[1], scale * torch.tensor([2.0 * r, 2.0 * r + 1]))


@pytest.mark.parametrize("op_name", ["SUM", "AVG"])
def test_reduce_scatter_single_coalesced(runners, ws, op_name):
    runners.run(ws, _reduce_scatter_single_coalesced, op_name)


# --- all_to_all -------------------------------------------------------------------------


def _all_to_all_list() -> None:
    r, ws = _rank()
    inputs = [torch.tensor([float(r * ws + j)]) for j in range(ws)]
    outputs = [torch.zeros(1) for _ in range(ws)]
    dist.all_to_all(outputs, inputs)
    for j, t in enumerate(outputs):
        _eq(t, torch.tensor([float(j * ws + r)]))


def test_all_to_all_list(runners, ws):
    runners.run(ws, _all_to_all_list)


def _all_to_all_single_uneven() -> None:
    r, ws = _rank()

    def size(src: int, dst: int) -> int:  # elements src sends to dst: varies on both
        return src + 2 * dst + 1

    in_splits = [size(r, j) for j in range(ws)]
    out_splits = [size(j, r) for j in range(ws)]

    def chunk(src: int, dst: int) -> torch.Tensor:  # rows differ, so order is checked
        rows = torch.arange(size(src, dst), dtype=torch.float32) + 1000 * src + 100 * dst
        return torch.stack([rows, -rows], dim=1)

    inp = torch.cat([chunk(r, j) for j in range(ws)])
    out = torch.zeros(sum(out_splits), 2)
    dist.all_to_all_single(out, inp, out_splits, in_splits)
    expected = torch.cat([chunk(j, r) for j in range(ws)])
    _eq(out, expected)
    even_out = torch.zeros(ws)
    dist.all_to_all_single(even_out, torch.arange(ws, dtype=torch.float32) + 10 * r)
    _eq(even_out, torch.arange(ws, dtype=torch.float32) * 10 + r)


def test_all_to_all_single_uneven(runners, ws):
    runners.run(ws, _all_to_all_single_uneven)


# --- point to point, barrier, async handles, object collectives ----------------------


def _send_recv_ring() -> None:
    r, ws = _rank()
    out = torch.zeros(3)
    # Non-blocking ring: every rank sends before receiving (would deadlock if blocking).
    send = dist.isend(torch.full((3,), float(r + 1)), dst=(r + 1) % ws)
    recv = dist.irecv(out, src=(r - 1) % ws)
    send.wait()
    recv.wait()
    _eq(out, torch.full((3,), float((r - 1) % ws + 1)))
    # Tags match sends to receives posted in the other order: rank 2k -> 2k+1. (Blocking
    # sends here would deadlock on gloo/NCCL too, and are reported as a deadlock.)
    if r % 2 == 0 and r + 1 < ws:
        works = [
            dist.isend(torch.tensor([1.0]), dst=r + 1, tag=7),
            dist.isend(torch.tensor([2.0]), dst=r + 1, tag=8),
        ]
        for work in works:
            work.wait()
    elif r % 2 == 1:
        second, first = torch.zeros(1), torch.zeros(1)
        dist.recv(second, src=r - 1, tag=8)
        dist.recv(first, src=r - 1, tag=7)
        _eq(first, torch.tensor([1.0]))
        _eq(second, torch.tensor([2.0]))


def test_send_recv(runners, ws):
    runners.run(ws, _send_recv_ring)


def _batch_isend_irecv() -> None:
    r, ws = _rank()
    received = torch.zeros(2)
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(r + 1)), (r + 1) % ws),
        dist.P2POp(dist.irecv, received, (r - 1) % ws),
    ]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    _eq(received, torch.full((2,), float((r - 1) % ws + 1)))


def test_batch_isend_irecv(runners, ws):
    runners.run(ws, _batch_isend_irecv)


def _barrier(arrived: list) -> None:
    r, ws = _rank()
    arrived.append(r)
    dist.barrier()
    # Every rank appended before any rank got past the barrier.
    assert sorted(arrived[:ws]) == list(range(ws)), arrived


def test_barrier(runners, ws):
    runners.run(ws, _barrier, [])


def _async_work(issued: list) -> None:
    r, ws = _rank()
    t = torch.full((2,), float(r + 1))
    work = dist.all_reduce(t, async_op=True)
    issued.append(r)
    # Only this rank runs until it waits: the op is complete iff this rank was the last.
    assert work.is_completed() == (len(issued) == ws)
    future = work.get_future()
    work.wait()
    assert work.is_completed()
    _eq(future.wait()[0], torch.full((2,), ws * (ws + 1) / 2))
    _eq(t, torch.full((2,), ws * (ws + 1) / 2))


def test_async_work(runners, ws):
    runners.run(ws, _async_work, [])


def _future_waited_for_in_cpp() -> None:
    r, ws = _rank()
    t = torch.full((2,), float(r + 1))
    future = dist.all_reduce(t, async_op=True).get_future()
    # Waits in C++ without coming back to Python, as DDP's reducer waits for its buckets: the
    # other ranks must have run before, while this rank still held the baton.
    torch.futures.wait_all([future])
    _eq(t, torch.full((2,), ws * (ws + 1) / 2))


def test_a_future_waited_for_in_cpp_completes(runners, ws):
    runners.run(ws, _future_waited_for_in_cpp)


def _future_of_a_collective_the_others_join_later() -> None:
    r, ws = _rank()
    t = torch.full((2,), float(r + 1))
    token = torch.zeros(1)
    if r == 0:
        work = dist.all_reduce(t, async_op=True)
        future = work.get_future()  # the others wait for the token: this rank goes on
        assert not future.done()
        for peer in range(1, ws):
            dist.send(token, peer)
        work.wait()
        assert future.done()
    else:
        dist.recv(token, 0)
        dist.all_reduce(t)
    _eq(t, torch.full((2,), ws * (ws + 1) / 2))


def test_a_future_taken_before_the_others_can_join_leaves_this_rank_running(runners, ws):
    runners.run(ws, _future_of_a_collective_the_others_join_later)


def _object_collectives() -> None:
    r, ws = _rank()
    gathered = [None] * ws
    dist.all_gather_object(gathered, {"rank": r, "name": f"r{r}"})
    assert gathered == [{"rank": j, "name": f"r{j}"} for j in range(ws)]
    box = [f"from {r}"]
    dist.broadcast_object_list(box, src=ws - 1)
    assert box == [f"from {ws - 1}"]


def test_object_collectives(runners, ws):
    runners.run(ws, _object_collectives)


# --- subgroups -------------------------------------------------------------------------


def _subgroups() -> None:
    r, ws = _rank()
    evens = dist.new_group([j for j in range(ws) if j % 2 == 0])
    odds = dist.new_group([j for j in range(ws) if j % 2 == 1])
    mine = evens if r % 2 == 0 else odds
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=mine)
    members = [j for j in range(ws) if j % 2 == r % 2]
    _eq(t, torch.tensor([float(sum(j + 1 for j in members))]))
    # A collective on the default group still lines up after subgroup traffic.
    w = torch.tensor([1.0])
    dist.all_reduce(w)
    _eq(w, torch.tensor([float(ws)]))
    assert dist.get_rank(mine) == members.index(r)
    assert dist.get_process_group_ranks(mine) == members


def test_subgroups(runners, ws):
    runners.run(ws, _subgroups)
