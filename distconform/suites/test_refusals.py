"""An implementation that does not declare a capability refuses it clearly.

Leaving a capability undeclared keeps its cases out of the pass rate (they are UNSUPPORTED),
so it must not be a way to hide a broken feature: used anyway, the feature must raise an
error that names it, at the call or at the latest in the first forward/backward. Silently
accepting it, or failing with an unrelated error, fails the case. Items exist only for the
capabilities the implementation leaves undeclared (``only_undeclared`` in the case table).

Capabilities that are compositions with another torch feature rather than an entry point
of the implementation (``pp``, ``dcp``, ``activation_checkpointing``) have no probe: there is
no call of the implementation's own to refuse.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)

from distconform.api import torch_api
from distconform.suites.cases import conformance, grid

Probe = Callable[[object, object, nn.Module], None]


def two_linears(device: torch.device) -> nn.Module:
    with torch.device(device):
        return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def train_once(model: nn.Module, device: torch.device) -> None:
    model(torch.randn(2, 8, device=device)).sum().backward()


def probe_replicate(rank_ctx, impl, model: nn.Module) -> None:
    impl.replicate(model)
    train_once(model, rank_ctx.device)


def probe_shard_placement_fn(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(param.ndim - 1))
    train_once(model, rank_ctx.device)


def probe_reshard_after_forward_int(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model[0], reshard_after_forward=2)
    impl.fully_shard(model)
    train_once(model, rank_ctx.device)


def probe_gradient_accumulation(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_requires_gradient_sync(False)
    train_once(model, rank_ctx.device)


def probe_async_unshard(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    handle = model.unshard(async_op=True)
    if handle is not None:
        handle.wait()
    train_once(model, rank_ctx.device)


def probe_forward_method(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model[0])
    impl.fully_shard(model)
    impl.register_fsdp_forward_method(model[0], "forward")
    train_once(model, rank_ctx.device)


def probe_hsdp(rank_ctx, impl, model: nn.Module) -> None:
    mesh = rank_ctx.mesh((2, rank_ctx.world_size // 2), ("replicate", "shard"))
    impl.fully_shard(model, mesh=mesh)
    train_once(model, rank_ctx.device)


def probe_mixed_precision(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    train_once(model, rank_ctx.device)


def probe_cpu_offload(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model, offload_policy=impl.CPUOffloadPolicy(pin_memory=False))
    train_once(model, rank_ctx.device)


def probe_prefetch(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model[2])
    impl.fully_shard(model[0])
    impl.fully_shard(model)
    model[0].set_modules_to_forward_prefetch([model[2]])
    model[2].set_modules_to_backward_prefetch([model[0]])
    train_once(model, rank_ctx.device)


def probe_post_optim_event(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    train_once(model, rank_ctx.device)
    model.set_post_optim_event(torch.accelerator.current_stream().record_event())
    train_once(model, rank_ctx.device)


def probe_share_comm_ctx(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model[0])
    impl.fully_shard(model[2])
    impl.share_comm_ctx([model[0], model[2]])
    train_once(model, rank_ctx.device)


def probe_tp(rank_ctx, impl, model: nn.Module) -> None:
    mesh = rank_ctx.mesh((1, rank_ctx.world_size), ("dp", "tp"))
    linear = model[0]
    linear.weight = nn.Parameter(distribute_tensor(linear.weight.detach(), mesh["tp"], [Shard(0)]))
    impl.fully_shard(model, mesh=mesh["dp"])
    train_once(model, rank_ctx.device)


def probe_ignored_params(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model, ignored_params={model[2].weight})
    train_once(model, rank_ctx.device)


def probe_all_reduce_hook(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_all_reduce_hook(lambda reduced: None)
    train_once(model, rank_ctx.device)


def probe_separate_reduce_scatter_group(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_separate_reduce_scatter_group()
    train_once(model, rank_ctx.device)


def probe_reduce_scatter_unused_params(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    train_once(model, rank_ctx.device)


def probe_custom_comms(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)

    class PlainAllGather:
        def allocate(self, size, *, dtype, device):
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return torch_api.all_gather_single(
                output_tensor, input_tensor, group=group, async_op=async_op
            )

    model.set_custom_all_gather(PlainAllGather())
    train_once(model, rank_ctx.device)


def probe_reduce_scatter_max_input_buffers(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_reduce_scatter_max_input_buffers(2)
    train_once(model, rank_ctx.device)


@dataclass
class NamedDims:
    """Stands in for ``DataParallelMeshDims`` where the implementation has none."""

    shard: str | None = None
    replicate: str | None = None


def probe_dp_mesh_dims(rank_ctx, impl, model: nn.Module) -> None:
    mesh = rank_ctx.mesh((rank_ctx.world_size,), ("dp",))
    distribute_module(model, mesh)
    dims = (impl.DataParallelMeshDims or NamedDims)(shard="dp")
    impl.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    inp = torch.randn(2, 8, device=rank_ctx.device)
    model(DTensor.from_local(inp, mesh, [Replicate()], run_check=False)).to_local().sum().backward()


def probe_manual_backward_finalization(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_manual_backward_finalization(True)
    train_once(model, rank_ctx.device)
    model.finalize_backward()


def probe_keep_unsharded_storage(rank_ctx, impl, model: nn.Module) -> None:
    impl.fully_shard(model)
    model.set_keep_unsharded_storage(True)
    train_once(model, rank_ctx.device)


#: capability -> (how to use it, words one of which the error must contain, lower case)
PROBES: dict[str, tuple[Probe, tuple[str, ...]]] = {
    "replicate": (probe_replicate, ("replicate",)),
    "shard_placement_fn": (probe_shard_placement_fn, ("shard_placement_fn", "placement")),
    "reshard_after_forward_int": (probe_reshard_after_forward_int, ("reshard_after_forward",)),
    "gradient_accumulation": (
        probe_gradient_accumulation,
        ("gradient_sync", "gradient sync", "gradient_accumulation", "accumulation"),
    ),
    "async_unshard": (probe_async_unshard, ("async",)),
    "forward_method": (probe_forward_method, ("forward_method", "forward method")),
    "hsdp": (probe_hsdp, ("hsdp", "2-d", "2d", "mesh")),
    "mixed_precision": (
        probe_mixed_precision,
        ("mixed precision", "mixed_precision", "mixedprecisionpolicy", "param_dtype"),
    ),
    "cpu_offload": (probe_cpu_offload, ("offload",)),
    "prefetch": (probe_prefetch, ("prefetch",)),
    "post_optim_event": (probe_post_optim_event, ("post_optim_event", "post-optim", "event")),
    "share_comm_ctx": (probe_share_comm_ctx, ("share_comm_ctx", "comm ctx", "comm_ctx")),
    "tp": (probe_tp, ("tensor parallel", "dtensor", "tp")),
    "ignored_params": (probe_ignored_params, ("ignored_params", "ignored")),
    "all_reduce_hook": (probe_all_reduce_hook, ("all_reduce_hook", "hook")),
    "dp_mesh_dims": (probe_dp_mesh_dims, ("dp_mesh_dims", "mesh dims", "spmd")),
    "manual_backward_finalization": (
        probe_manual_backward_finalization,
        ("finalize_backward", "finalization", "manual"),
    ),
    "keep_unsharded_storage": (
        probe_keep_unsharded_storage,
        ("keep_unsharded_storage", "unsharded storage", "storage"),
    ),
    "custom_comms": (probe_custom_comms, ("custom", "all_gather", "all-gather", "comm")),
    "separate_reduce_scatter_group": (
        probe_separate_reduce_scatter_group,
        ("separate_reduce_scatter_group", "reduce_scatter", "reduce-scatter"),
    ),
    "reduce_scatter_max_input_buffers": (
        probe_reduce_scatter_max_input_buffers,
        ("max_input_buffers", "input buffers", "reduce_scatter"),
    ),
    "reduce_scatter_unused_params": (
        probe_reduce_scatter_unused_params,
        ("unused_params", "unused", "reduce_scatter"),
    ),
}


@conformance("refusal.undeclared_capability")
@pytest.mark.parametrize("point", grid(capability=sorted(PROBES)))
def test_undeclared_capability_is_refused(rank_ctx, impl, point):
    capability = point["capability"]
    probe, words = PROBES[capability]
    model = two_linears(rank_ctx.device)
    try:
        probe(rank_ctx, impl, model)
    except Exception as error:  # any error type will do; its words must name the feature
        text = f"{type(error).__name__}: {error}"
        assert any(word in text.lower() for word in words), (
            f"{impl.name} does not declare {capability!r} and refused it, but the error does "
            f"not name the feature (expected one of {list(words)}): {text}"
        )
        return
    raise AssertionError(
        f"{impl.name} does not declare the capability {capability!r} yet accepted it "
        f"silently: either declare it (and pass its cases) or raise an error naming it"
    )
