"""Tensor parallel composed with fully_shard (2-D and 3-D HSDP meshes) and replicate.

The MLP stack is first parallelised with ``torch.distributed.tensor.parallel`` (its
parameters become DTensors on the ``tp`` mesh), then the data-parallel implementation puts its
own mesh dimensions in front: ``("dp", "tp")`` at world size 4, ``("dp_replicate",
"dp_shard", "tp")`` at world size 8 (HSDP), ``("dp_replicate", "tp")`` for replicate. Each is
trained next to a plain copy whose gradients are averaged over the data-parallel ranks (the
TP ranks of one replica see the same data): losses equal every step at fp32 default
tolerance; parameters' ``full_tensor()`` (strided sharding when dp and tp split the same dim)
equal the copy's before training and after it, and gradients every step (losses alone would
miss a missing average: Adam is invariant to the gradients' scale). Gradients and parameters
may differ by what the sharded sums' other order can explain, no more: the bound is derived
from the longest sum and the dtype, and followed through Adam per element
(:mod:`distconform.suites.reordered_sums`); an accelerator's matmuls order their sums differently
again.

Activation checkpointing wraps each child's ``forward`` in ``torch.utils.checkpoint``
(non-reentrant) on the instance, so the data-parallel hooks of the module still run around
it and parameter names do not change.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.tensor.parallel as tensor_parallel
import torch.utils.checkpoint
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from distconform.api import (
    CommTracer,
    ReferenceModel,
    assert_losses_equal,
    assert_tensors_close,
    padded_numel,
    tolerance,
)
from distconform.suites.cases import conformance
from distconform.suites.models import MLPStack, ModelArgs, Transformer
from distconform.suites.reordered_sums import AdamDrift, longest_reduction
from distconform.suites.training import STEPS, SUMMED_LOGITS_GRAD_TOLERANCE

#: Upstream uses 3, 5, 16 and 17. With dp = tp = 2 the odd ones shard alike: the column-
#: parallel ``in_proj`` (4 * dim rows) splits evenly over tp and then dp, and the row-parallel
#: ``out_proj`` (dim rows, sharded by fully_shard) splits unevenly (2+1, 3+2, 9+8). 3 keeps the
#: uneven shape and 16 the even one.
MLP_DIMS = (3, 16)


def adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-2, foreach=False)


def mlp_stack_tp_plan() -> dict:
    """Upstream ``MLPStack``'s TP plan without sequence parallel."""
    plan: dict = {}
    for index in range(3):
        plan[f"{index}.in_proj"] = ColwiseParallel(use_local_output=False)
        plan[f"{index}.out_proj"] = RowwiseParallel(use_local_output=False)
    plan["2.out_proj"] = RowwiseParallel()
    return plan


def checkpoint_forward(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed(*args, **kwargs):
        return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed


def full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def assert_full_parity(
    reference: nn.Module, model: nn.Module, *, grads: bool, drift: AdamDrift | None = None
) -> None:
    """Every parameter (and gradient) gathered whole equals the reference's, by name; with
    ``drift``, up to what reordered sums may have made of them (suites/reordered_sums.py)."""
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        ref_param = ref_params[name]
        what = f"parameter {name!r}"
        if drift is None:
            assert_tensors_close(what, full(param.detach()), ref_param.detach())
        else:
            drift.assert_within(what, name, full(param.detach()), ref_param.detach())
        if grads:
            assert (param.grad is None) == (ref_param.grad is None), f"gradient of {name!r}"
            if param.grad is not None:
                _, atol = tolerance(ref_param.grad.dtype)
                if drift is not None:
                    atol += drift.gradient_bound(name)
                what = f"gradient of {name!r}"
                assert_tensors_close(what, full(param.grad), ref_param.grad, atol=atol)


def assert_meshes(model: nn.Module, names: tuple[str, ...]) -> None:
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is a {type(param).__name__}, not a DTensor"
        assert param.device_mesh.mesh_dim_names == names, (name, param.device_mesh)
        assert len(param.placements) == len(names), (name, param.placements)


def grid(*axes: tuple[str, tuple]) -> list:
    """The cartesian product of named axes, ids ``name=value-...`` (the case table's tokens:
    ``ac=True`` needs the activation-checkpointing capability)."""
    params = []
    for values in itertools.product(*(choices for _, choices in axes)):
        named = dict(zip((name for name, _ in axes), values, strict=True))
        params.append(pytest.param(*values, id="-".join(f"{k}={v}" for k, v in named.items())))
    return params


def train_with_data_parallel(
    rank_ctx,
    model: nn.Module,
    reference: ReferenceModel,
    dp_rank: int,
    mlp_dim: int,
    *,
    check_grads: bool,
) -> None:
    optimizer = adam(model.parameters())
    batch = 8
    tokens = batch * dist.get_world_size(reference.group)
    length = longest_reduction(reference.module, tokens)
    drift = AdamDrift(reference.module, reference.optimizer, length)
    assert_full_parity(reference.module, model, grads=False)
    torch.manual_seed(42 + dp_rank + 1)
    for step in range(STEPS):
        inp = torch.randn(batch, mlp_dim, device=rank_ctx.device)
        loss = model(inp).sum()
        loss.backward()
        reference_loss = reference.forward_backward(lambda m, inp=inp: m(inp).sum())
        assert_losses_equal(step, loss, reference_loss)
        drift.before_step()
        if check_grads:
            assert_full_parity(reference.module, model, grads=True, drift=drift)
        optimizer.step()
        set_to_none = step % 2 == 0
        optimizer.zero_grad(set_to_none=set_to_none)
        reference.step(set_to_none=set_to_none)
        drift.after_step()
    assert_full_parity(reference.module, model, grads=False, drift=drift)


def fully_shard_after_tp(impl, model: MLPStack, tp_mesh, dp_mesh, ac: bool, raf: bool) -> None:
    tensor_parallel.parallelize_module(model, tp_mesh, mlp_stack_tp_plan())
    for child in model:
        if ac:
            checkpoint_forward(child)
        impl.fully_shard(child, mesh=dp_mesh, reshard_after_forward=raf)
    impl.fully_shard(model, mesh=dp_mesh, reshard_after_forward=raf)


FSDP_TP_GRID = grid(("raf", (False, True)), ("ac", (False, True)), ("dim", MLP_DIMS))


@conformance("fsdp.tp.2d_mesh")
@pytest.mark.parametrize(("raf", "ac", "mlp_dim"), FSDP_TP_GRID)
def test_2d_fully_shard_tp(rank_ctx, impl, raf, ac, mlp_dim):
    mesh = rank_ctx.mesh((2, 2), ("dp", "tp"))
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=mesh["dp"].get_group())
    fully_shard_after_tp(impl, model, mesh["tp"], mesh["dp"], ac, raf)
    train_with_data_parallel(
        rank_ctx, model, reference, mesh["dp"].get_local_rank(), mlp_dim, check_grads=True
    )
    assert_meshes(model, ("dp", "tp"))


@conformance("fsdp.tp.3d_hsdp_mesh")
@pytest.mark.parametrize(("raf", "ac", "mlp_dim"), FSDP_TP_GRID)
def test_3d_hsdp_tp(rank_ctx, impl, raf, ac, mlp_dim):
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = rank_ctx.mesh((2, 2, 2), names)
    # The data-parallel ranks of one TP coordinate, as one group for the reference: the same
    # ranks, row-major, as the (dp_replicate, dp_shard) sub-mesh.
    dp_flat = rank_ctx.mesh((4, 2), ("dp", "tp"))["dp"]
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=dp_flat.get_group())
    fully_shard_after_tp(impl, model, mesh["tp"], mesh["dp_replicate", "dp_shard"], ac, raf)
    train_with_data_parallel(
        rank_ctx, model, reference, dp_flat.get_local_rank(), mlp_dim, check_grads=True
    )
    assert_meshes(model, names)


@conformance("replicate.tp")
@pytest.mark.parametrize(("ac", "mlp_dim"), grid(("ac", (False, True)), ("dim", MLP_DIMS)))
def test_replicate_tp(rank_ctx, impl, ac, mlp_dim):
    names = ("dp_replicate", "tp")
    mesh = rank_ctx.mesh((2, 2), names)
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=mesh["dp_replicate"].get_group())
    tensor_parallel.parallelize_module(model, mesh["tp"], mlp_stack_tp_plan())
    for child in model:
        if ac:
            checkpoint_forward(child)
        impl.replicate(child, mesh=mesh["dp_replicate"])
    impl.replicate(model, mesh=mesh["dp_replicate"])
    train_with_data_parallel(
        rank_ctx,
        model,
        reference,
        mesh["dp_replicate"].get_local_rank(),
        mlp_dim,
        check_grads=True,
    )
    assert_meshes(model, names)


# --- shard_placement_fn with TP (upstream test_shard_placement_fn_tp_ep) ------------------------

TP_EP_ARGS = ModelArgs(n_layers=2, vocab_size=256, max_seq_len=32, dim=64, n_heads=4, dropout_p=0.0)


def parallelize_transformer(model: Transformer, tp_mesh) -> None:
    """The TP plan upstream uses for its dense test Transformer, attention outputs kept as
    DTensors (``local_output_for_attn=False``), weight tying re-applied."""
    tensor_parallel.parallelize_module(
        model,
        tp_mesh,
        {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "pos_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        },
    )
    for block in model.layers:
        tensor_parallel.parallelize_module(
            block,
            tp_mesh,
            {
                "attention.wq": ColwiseParallel(use_local_output=False),
                "attention.wk": ColwiseParallel(use_local_output=False),
                "attention.wv": ColwiseParallel(use_local_output=False),
                "attention.wo": RowwiseParallel(),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(),
            },
        )
    if model.model_args.weight_tying:
        model.output.weight = model.tok_embeddings.weight


def tp_ep_grid() -> list:
    """Ids ``tp=..-dpr=..-reshard=..``: the case table gives ``tp=2`` its capability and its
    CPU skip (see the evidence test below), ``dpr=2`` and ``reshard=2`` theirs."""
    params = []
    for tp, dp_replicate, reshard in itertools.product((1, 2), (1, 2), (False, True, 2)):
        params.append(
            pytest.param(
                tp, dp_replicate, reshard, id=f"tp={tp}-dpr={dp_replicate}-reshard={reshard}"
            )
        )
    return params


@conformance("fsdp.tp.shard_placement_fn_tp_ep")
@pytest.mark.parametrize(("tp", "dp_replicate", "reshard"), tp_ep_grid())
def test_shard_placement_fn_tp_ep(rank_ctx, impl, tp, dp_replicate, reshard):
    """The dense part of the upstream test: blocks sharded through ``shard_placement_fn``,
    the tied embedding/output/norm as one group, the root, on 1-D, HSDP and TP meshes.

    Expert parallelism is left out: the expert parameters' own FSDP mesh is chosen by
    returning torch's private ``ShardPlacementResult`` / mesh-info types from
    ``shard_placement_fn``, which neither torch 2.13's public API nor ``distconform.impl.api``
    offers.
    """
    world = rank_ctx.world_size
    dp_size = world // tp
    dp_shard = dp_size // dp_replicate
    tp_mesh = None
    if tp > 1 and dp_replicate > 1:
        mesh = rank_ctx.mesh((dp_replicate, dp_shard, tp), ("dp_replicate", "dp_shard", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp_replicate", "dp_shard"]
    elif dp_replicate > 1:
        dp_mesh = rank_ctx.mesh((dp_replicate, dp_shard), ("dp_replicate", "dp_shard"))
    elif tp > 1:
        mesh = rank_ctx.mesh((dp_size, tp), ("dp", "tp"))
        tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    else:
        dp_mesh = rank_ctx.mesh(world, ("fsdp",))
    # The reference averages over the ranks of one TP coordinate (row-major, like dp_mesh).
    dp_group = rank_ctx.mesh((dp_size, tp), ("dp", "tp"))["dp"].get_group()

    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = Transformer(TP_EP_ARGS)
    reference = ReferenceModel(model, lambda ps: torch.optim.Adam(ps, lr=1e-2), group=dp_group)
    if tp_mesh is not None:
        parallelize_transformer(model, tp_mesh)
        reshard = True
    for block in model.layers:
        impl.fully_shard(block, mesh=dp_mesh, shard_placement_fn=lambda _param: Shard(0))
    impl.fully_shard(
        [model.tok_embeddings, model.norm, model.output],
        mesh=dp_mesh,
        reshard_after_forward=reshard,
    )
    impl.fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert_full_parity(reference.module, model, grads=False)

    torch.manual_seed(42 + rank_ctx.rank // tp)
    rtol, atol = SUMMED_LOGITS_GRAD_TOLERANCE
    for step in range(5):
        inp = torch.randint(
            0, TP_EP_ARGS.vocab_size, (2, TP_EP_ARGS.max_seq_len), device=rank_ctx.device
        )
        loss = model(inp).sum()
        loss.backward()
        reference_loss = reference.forward_backward(lambda m, inp=inp: m(inp).sum())
        assert_losses_equal(step, loss, reference_loss)
        for name, param in model.named_parameters():
            ref_grad = reference.module.get_parameter(name).grad
            assert_tensors_close(
                f"gradient of {name!r}", full(param.grad), ref_grad, rtol=rtol, atol=atol
            )
        optimizer.step()
        set_to_none = step % 2 == 0
        optimizer.zero_grad(set_to_none=set_to_none)
        reference.step(set_to_none=set_to_none)


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_cpu_attention_on_tp_activations_has_no_sharding_strategy(rank_ctx):
    """The evidence for the ``CPU:`` skip of the tp=2 items above (suites/cases.toml): on
    CPU, torch 2.13 has no DTensor sharding strategy for the attention kernel that TP-sharded
    q/k/v reach. When this starts failing, torch has one and the tp=2 items can run on CPU."""
    if rank_ctx.device_type != "cpu":
        pytest.skip("checks a CPU-only limitation")
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(dropout_p=0.0))
    parallelize_transformer(model, rank_ctx.mesh(rank_ctx.world_size, ("tp",)))
    no_strategy = r"flash_attention_for_cpu\S* does not have a sharding strategy"
    with pytest.raises(NotImplementedError, match=no_strategy):
        model(torch.randint(0, 8, (2, 16), device=rank_ctx.device))


@pytest.mark.slow
@pytest.mark.world_size(2)
def test_math_attention_on_tp_activations_cannot_be_sharded_on_the_fake_device(rank_ctx):
    """The evidence for the ``FAKEACCEL:`` skip of the tp=2 items above (the fake device's
    ``case_skips``, harness/devices/fakeaccel):
    off CUDA, SDPA takes its math path, and DTensor cannot run it on TP-sharded q/k/v (a plain
    tensor meets the DTensors). When this starts failing, the tp=2 items can run there."""
    if rank_ctx.device_type != "fakeaccel":
        pytest.skip("checks a limitation of the fake accelerator")
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = Transformer(ModelArgs(dropout_p=0.0))
    parallelize_transformer(model, rank_ctx.mesh(rank_ctx.world_size, ("tp",)))
    with pytest.raises(RuntimeError, match=r"got mixed torch\.Tensor and DTensor"):
        model(torch.randint(0, 8, (2, 16), device=rank_ctx.device))


# --- the documented layouts and the collectives they imply -------------------------------------

#: How ``mlp_stack_tp_plan`` splits each kind of parameter over tp (``ColwiseParallel`` shards
#: the weight's rows and the bias, ``RowwiseParallel`` the weight's columns and replicates the
#: bias): the dim of the full tensor tp splits, or None.
TP_DIM = {"in_proj.weight": 0, "in_proj.bias": 0, "out_proj.weight": 1, "out_proj.bias": None}


def expected_local(full_param: torch.Tensor, name: str, dp: tuple[int, int], tp: tuple[int, int]):
    """This rank's local tensor under the documented layout: tp takes its chunk of the dim
    its style splits, then fully_shard takes its dim-0 chunk of that over dp (strided when
    both split dim 0). ``dp`` and ``tp`` are (coordinate, size)."""
    tensor = full_param.detach()
    tp_dim = TP_DIM[name.split(".", 1)[1]]
    if tp_dim is not None:
        tensor = torch.chunk(tensor, tp[1], dim=tp_dim)[tp[0]]
    chunks = torch.chunk(tensor, dp[1], dim=0)
    return chunks[dp[0]] if dp[0] < len(chunks) else tensor.new_empty((0, *tensor.shape[1:]))


def assert_documented_layout(model, reference, what: str, dp, tp, *, grads: bool) -> None:
    ref = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        source = ref[name].grad if grads else ref[name]
        value = param.grad if grads else param
        expected = expected_local(source, name, dp, tp)
        torch.testing.assert_close(
            value.to_local().reshape(expected.shape),
            expected,
            msg=lambda m, n=name: (
                f"{what} of {n!r} on (dp {dp[0]}, tp {tp[0]}): the local tensor is not the "
                f"documented {('Colwise' if TP_DIM[n.split('.', 1)[1]] == 0 else 'Rowwise')}"
                f"Parallel then fully_shard dim-0 chunk: {m}"
            ),
        )


@conformance("fsdp.tp.layout")
@pytest.mark.parametrize("mlp_dim", MLP_DIMS, ids=[f"dim={d}" for d in MLP_DIMS])
def test_tp_layout_and_collectives(rank_ctx, impl, mlp_dim):
    """Fails on ``tests.suites.broken:fsdp_over_dim1_torch`` (fully_shard splitting dim 1,
    the same numbers: "the local tensor is not the documented ColwiseParallel then fully_shard
    dim-0 chunk") and on ``always_communicate_torch`` (an all-reduce on the world group)."""
    mesh = rank_ctx.mesh((2, 2), ("dp", "tp"))
    dp = (mesh["dp"].get_local_rank(), mesh["dp"].size())
    tp = (mesh["tp"].get_local_rank(), mesh["tp"].size())
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = MLPStack(mlp_dim)
    reference = ReferenceModel(model, adam, group=mesh["dp"].get_group())
    tensor_parallel.parallelize_module(model, mesh["tp"], mlp_stack_tp_plan())
    tp_locals = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    for child in model:
        impl.fully_shard(child, mesh=mesh["dp"], reshard_after_forward=False)
    impl.fully_shard(model, mesh=mesh["dp"], reshard_after_forward=False)
    assert_documented_layout(model, reference.module, "parameter", dp, tp, grads=False)

    torch.manual_seed(42 + dp[0] + 1)
    inp = torch.randn(8, mlp_dim, device=rank_ctx.device)
    with CommTracer(mesh=mesh) as trace:
        model(inp).sum().backward()
    reference.forward_backward(lambda m: m(inp).sum())
    assert_documented_layout(model, reference.module, "gradient", dp, tp, grads=True)

    # fully_shard's traffic runs on dp only, one all-gather per group in forward (no reshard
    # after forward: none in backward) of the tp-local shards, one reduce-scatter per group;
    # tensor parallel's on tp only (all-reduces of partial outputs and input gradients).
    misplaced = [
        c.describe()
        for c in trace.calls
        if (c.kind in ("all_gather", "reduce_scatter") and c.group != "dp")
        or (c.kind not in ("all_gather", "reduce_scatter") and c.group != "tp")
    ]
    assert not misplaced, (
        "collectives on the wrong group (fully_shard's all-gathers and reduce-scatters belong "
        "on dp, tensor parallel's all-reduces on tp):\n" + "\n".join(misplaced)
    )
    gathers = trace.select("all_gather", group="dp")
    expected_sizes = [
        sum(padded_numel(tp_locals[f"{index}.{name}"].shape, dp[1]) // dp[1] for name in TP_DIM)
        for index in range(len(model))
    ]
    assert [(c.phase, c.numel) for c in gathers] == [("forward", n) for n in expected_sizes], (
        f"fully_shard's all-gathers (phase, per-rank numel) {[(c.phase, c.numel) for c in gathers]}"
        f", expected one per MLP in forward of its tp-local padded shards "
        f"{[('forward', n) for n in expected_sizes]}"
    )
    scatters = trace.select("reduce_scatter", group="dp")
    assert len(scatters) == len(model), (
        f"{len(scatters)} reduce-scatters on dp, expected one per MLP ({len(model)})"
    )
