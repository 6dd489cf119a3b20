"""The backend suite's capability names: operations, reduce ops, dtypes and semantics a c10d
backend can declare (``suites/backend/declaration.py`` reads a declaration).

They live here, below both ``suites/cases.py`` (which validates the backend case table
against them) and ``suites/backend/`` (whose tests are tied to that table), as the
implementation's names live in ``impl/api.py``.
"""

from __future__ import annotations

REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum")
DTYPES = (
    "float32",
    "float64",
    "float16",
    "bfloat16",
    "int8",
    "int32",
    "int64",
    "bool",
    "complex64",
)

OPERATIONS = {
    "all_reduce": "all_reduce",
    "broadcast": "broadcast from every source rank",
    "reduce": "reduce to every destination rank",
    "all_gather": "all_gather (list) and all_gather_single with equal sizes",
    "all_gather_uneven": "all_gather (list) with a different size per rank",
    "reduce_scatter": "reduce_scatter (list) and reduce_scatter_single",
    "all_to_all": "all_to_all (list, equal sizes) and all_to_all_single with even and uneven "
    "splits",
    "all_to_all_uneven": "all_to_all (list) with a different size per pair of ranks",
    "gather": "gather to every destination rank",
    "scatter": "scatter from every source rank",
    "barrier": "barrier",
    "send_recv": "send / recv and isend / irecv",
    "batch_isend_irecv": "batch_isend_irecv",
    "object_collectives": "all_gather_object, gather_object, broadcast_object_list, "
    "scatter_object_list, send/recv_object_list",
    "coalesced": "the ProcessGroup's coalesced calls (allreduce_coalesced, "
    "allgather_into_tensor_coalesced, reduce_scatter_tensor_coalesced)",
    "deprecated_coalesced": "the deprecated dist.all_reduce_coalesced and "
    "dist.all_gather_coalesced (the group's allreduce_coalesced and allgather_coalesced)",
    "new_group": "sub-groups from new_group used concurrently with the default group",
    "split_group": "sub-groups from split_group",
    "device_mesh": "DeviceMesh sub-meshes",
    "functional": "the functional collectives DTensor, FSDP2 and torch.compile issue "
    "(all_reduce, all_gather_single, reduce_scatter_single, all_to_all_single, wait_tensor)",
    "dtensor": "DTensor redistributions (Shard <-> Replicate <-> Partial)",
    "async_work": "async_op=True: wait, is_completed, get_future, several outstanding works",
    "timeout": "a rank that never joins makes the others fail within the group's timeout",
    "abort": "an aborted group refuses every later collective",
    "mismatch_detection": "ranks disagreeing on a collective's shape or dtype get an error",
}

KNOWN_BACKEND_CAPABILITIES = frozenset(
    {
        *OPERATIONS,
        *(f"reduce_op.{op}" for op in REDUCE_OPS),
        *(f"dtype.{dtype}" for dtype in DTYPES),
    }
)
