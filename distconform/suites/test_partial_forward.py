"""Partial-group forward, standalone chunks and related structure cases.

The hidden state is computed without the head (``skip_head=True``: the ``[norm, head]``
group runs only part of its modules), then the head runs standalone per chunk with its own
backward, each chunk accumulating into the head's gradient, and finally the hidden state's
backward. Grouped and ungrouped sharding, weight tying and mixed-precision output dtypes
vary; the other cases toggle resharding mid-step (the head, kept unsharded, is gathered at
most once for all its chunks), recover from an exception in forward, and run two forwards
before one backward with nested groups, with or without checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.api import (
    assert_losses_equal,
    assert_sharded_parity,
    assert_tensors_close,
    average_gradients,
)
from distconform.suites.cases import conformance, grid, grid_id
from distconform.suites.models import ChunkedHeadModel, Transformer
from distconform.suites.training import (
    STEPS,
    SUMMED_LOGITS_GRAD_TOLERANCE,
    adam,
    checkpoint_in_place,
    counting,
    local,
    transformer,
    zero_grad,
)

DIM, VOCAB = 32, 128


def snapshot(grad: torch.Tensor) -> torch.Tensor:
    return grad.full_tensor() if isinstance(grad, DTensor) else grad.detach().clone()


def run_chunked(
    model: nn.Module, tokens: torch.Tensor, h_dtype: torch.dtype, n_chunks: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed head loss, head-weight gradient after the last chunk)."""
    h = model(tokens, skip_head=True)
    assert h.dtype == h_dtype, f"hidden state is {h.dtype}, expected {h_dtype}"
    total = torch.zeros((), device=h.device)
    chunk_grads, snapshots = [], []
    for chunk in h.detach().float().chunk(n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        out = model.head(chunk)
        assert out.dtype == h_dtype, f"head output is {out.dtype}, expected {h_dtype}"
        loss = out.sum()
        total = total + loss.detach().float()
        loss.backward()
        chunk_grads.append(chunk.grad)
        snapshots.append(snapshot(model.head.weight.grad))
    previous = torch.zeros_like(snapshots[0])
    for index, snap in enumerate(snapshots):
        assert (snap - previous).norm() > 0, f"chunk {index} added nothing to the head gradient"
        previous = snap
    h.backward(torch.cat(chunk_grads, dim=1).to(h.dtype))
    return total, snapshots[-1]


BF16_OUT = {"param_dtype": torch.float32, "output_dtype": torch.bfloat16}


def policies(impl, mode: str):
    """(inner policy, root policy, expected hidden dtype)."""
    mp = impl.MixedPrecisionPolicy
    if mode == "bf16_everywhere":
        return mp(**BF16_OUT), mp(**BF16_OUT), torch.bfloat16
    if mode == "bf16_inner_only":
        return mp(**BF16_OUT), mp(param_dtype=torch.float32), torch.bfloat16
    return mp(), mp(), torch.float32


def shard_chunked(impl, m: nn.Module, *, grouped: bool, tie: bool, raf, inner, root) -> None:
    def shard(module, policy) -> None:
        impl.fully_shard(module, reshard_after_forward=raf, mp_policy=policy)

    if grouped and tie:
        shard(m.body, root)
        shard([m.embed, m.norm, m.head], inner)
    else:
        shard(m.embed, root)
        shard(m.body, root)
        if grouped:
            shard([m.norm, m.head], inner)
        else:
            shard(m.norm, inner)
            shard(m.head, inner)
    shard(m, root)


PARTIAL_GRID = [
    *grid(
        raf=[True, False],
        tie=[False, True],
        mp=["none", "bf16_everywhere", "bf16_inner_only"],
        ac=[False],
    ),
    pytest.param(
        {"raf": True, "tie": False, "mp": "none", "ac": True},
        id=grid_id(raf=True, tie=False, mp="none", ac=True),
    ),
    pytest.param(
        {"raf": 1, "tie": False, "mp": "none", "ac": False},
        id=grid_id(raf=1, tie=False, mp="none", ac=False),
    ),
]


@conformance("fsdp.partial.forward_then_standalone")
@pytest.mark.parametrize("point", PARTIAL_GRID)
def test_partial_group_forward_then_standalone(rank_ctx, impl, point):
    raf, tie, mode, ac = point["raf"], point["tie"], point["mp"], point["ac"]
    inner, root, h_dtype = policies(impl, mode)
    do_parity = mode == "none"
    do_grouping_parity = not tie

    def new_model() -> nn.Module:
        torch.manual_seed(42)
        with torch.device(rank_ctx.device):
            m = ChunkedHeadModel(DIM, VOCAB, tie)
        if ac:
            checkpoint_in_place(m.body)
        return m

    def sharded(grouped: bool) -> nn.Module:
        m = new_model()
        shard_chunked(impl, m, grouped=grouped, tie=tie, raf=raf, inner=inner, root=root)
        return m

    torch.manual_seed(42)
    tokens = torch.randint(0, VOCAB, (2, 16), device=rank_ctx.device)
    reference = new_model()
    ref_optimizer = adam(reference.parameters())
    model = sharded(True)
    optimizer = adam(model.parameters())
    ungrouped = sharded(False) if do_grouping_parity else None
    ungrouped_optimizer = adam(ungrouped.parameters()) if ungrouped is not None else None

    for step in range(STEPS):
        loss, head_grad = run_chunked(model, tokens, h_dtype)
        if ungrouped is not None:
            u_loss, u_head_grad = run_chunked(ungrouped, tokens, h_dtype)
            assert_losses_equal(step, loss, u_loss)
            assert_tensors_close("head gradient, grouped vs ungrouped", head_grad, u_head_grad)
            for (name, p), u in zip(model.named_parameters(), ungrouped.parameters(), strict=True):
                assert_tensors_close(f"gradient of {name}", local(p.grad), local(u.grad))
        if do_parity:
            ref_loss, ref_head_grad = run_chunked(reference, tokens, torch.float32)
            world = torch.distributed.get_world_size()
            torch.distributed.all_reduce(ref_head_grad)
            ref_head_grad /= world
            average_gradients(reference)
            assert_tensors_close("head gradient", head_grad, ref_head_grad)
            assert_losses_equal(step, loss, ref_loss)
            assert_sharded_parity(reference, model)
            ref_optimizer.step()
            zero_grad(ref_optimizer, step)
        optimizer.step()
        zero_grad(optimizer, step)
        if ungrouped is not None:
            ungrouped_optimizer.step()
            zero_grad(ungrouped_optimizer, step)
            for (name, p), u in zip(model.named_parameters(), ungrouped.parameters(), strict=True):
                assert_tensors_close(f"parameter {name}", local(p), local(u))


class GroupedCastModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32, bias=False)
        self.b = nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # b receives fp32: its group's policy must cast its inputs too, not only a's.
        return self.b(self.a(x).float())


@conformance("fsdp.partial.grouped_cast_forward_inputs")
def test_grouped_module_cast_forward_inputs(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = GroupedCastModel()
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=True)
    impl.fully_shard([model.a, model.b], mp_policy=mp)
    impl.fully_shard(model, mp_policy=mp)
    out = model(torch.randn(2, 32, device=rank_ctx.device))
    assert out.dtype == torch.bfloat16, f"output is {out.dtype}"
    out.sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"


def chunk_backward(model: nn.Module, tokens: torch.Tensor, n_chunks: int) -> None:
    h = model(tokens, skip_head=True)
    grads = []
    for chunk in h.detach().chunk(n_chunks, dim=1):
        chunk = chunk.contiguous().requires_grad_(True)
        model.head(chunk).sum().backward()
        grads.append(chunk.grad)
    h.backward(torch.cat(grads, dim=1))


@conformance("fsdp.partial.grad_accum_chunked")
@pytest.mark.parametrize("point", grid(raf=[True, False]))
def test_partial_group_forward_grad_accum_chunked(rank_ctx, impl, point):
    raf = point["raf"]

    def setup(grouped: bool) -> nn.Module:
        torch.manual_seed(42)
        with torch.device(rank_ctx.device):
            m = ChunkedHeadModel(DIM, VOCAB)
        impl.fully_shard(m.embed, reshard_after_forward=raf)
        impl.fully_shard(m.body, reshard_after_forward=raf)
        if grouped:
            impl.fully_shard([m.norm, m.head], reshard_after_forward=raf)
        else:
            impl.fully_shard(m.norm, reshard_after_forward=raf)
            impl.fully_shard(m.head, reshard_after_forward=raf)
        impl.fully_shard(m, reshard_after_forward=raf)
        return m

    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        plain = ChunkedHeadModel(DIM, VOCAB)
    ungrouped, model = setup(False), setup(True)
    torch.manual_seed(42 + rank_ctx.rank)
    tokens_list = [torch.randint(0, VOCAB, (2, 16), device=rank_ctx.device) for _ in range(3)]
    for m in (ungrouped, model):
        for index, tokens in enumerate(tokens_list):
            last = index == len(tokens_list) - 1
            m.set_requires_gradient_sync(last)
            m.set_is_last_backward(last)
            chunk_backward(m, tokens, 2)
    for tokens in tokens_list:
        chunk_backward(plain, tokens, 2)
    average_gradients(plain)
    for (name, p), u in zip(model.named_parameters(), ungrouped.parameters(), strict=True):
        assert_tensors_close(f"gradient of {name}", local(p.grad), local(u.grad))
    # What the upstream test implies: accumulated and averaged like a plain model.
    assert_sharded_parity(plain, model)


@conformance("fsdp.partial.reshard_toggle")
@pytest.mark.parametrize("point", grid(tie=[False, True], initial_reshard=[False, True]))
def test_partial_group_reshard_toggle(rank_ctx, impl, point):
    tie, initial = point["tie"], point["initial_reshard"]
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = ChunkedHeadModel(DIM, VOCAB, tie)
    if tie:
        impl.fully_shard(model.body)
        impl.fully_shard([model.embed, model.norm, model.head], reshard_after_forward=initial)
    else:
        impl.fully_shard(model.embed)
        impl.fully_shard(model.body)
        impl.fully_shard([model.norm, model.head], reshard_after_forward=initial)
    impl.fully_shard(model)
    optimizer = adam(model.parameters())
    tokens = torch.randint(0, VOCAB, (2, 16), device=rank_ctx.device)
    head = model.head
    for step in range(5):
        h = model(tokens, skip_head=True)
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        grads = []
        with counting() as trace:
            for index, chunk in enumerate(h.detach().chunk(4, dim=1)):
                chunk = chunk.contiguous().requires_grad_(True)
                head(chunk).sum().backward()
                grads.append(chunk.grad)
                assert impl.is_group_unsharded(head), f"step {step}: resharded after chunk {index}"
        # Held unsharded, the head is gathered in forward once at most for its four chunks.
        # (Their backwards may prefetch another group: the implicit guess from forward order.)
        gathers = trace.count("all_gather", phase="forward")
        assert gathers <= 1, f"step {step}: {gathers} forward all-gathers\n{trace.schedule()}"
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.reshard()
        assert not impl.is_group_unsharded(head), f"step {step}: reshard() left it unsharded"
        h.backward(torch.cat(grads, dim=1).to(h.dtype))
        for name, p in model.named_parameters():
            assert p.grad is not None, f"step {step}: {name} has no gradient"
        optimizer.step()
        zero_grad(optimizer, step)


class _RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward raises: placed on a module's input, it fails a backward
    after the module's own weight gradients were produced."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")


class Raiser(nn.Module):
    """``inner``, failing when armed: in its forward, or in the backward through its input."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed == "forward":
            raise RuntimeError("boom")
        if self.armed == "backward":
            x = _RaiseInBackward.apply(x)
        return self.inner(x)


@conformance("fsdp.partial.reset_iter_state")
@pytest.mark.parametrize("point", grid(fails_in=["forward", "backward"]))
def test_reset_iter_state_after_exception(rank_ctx, impl, point):
    """A step fails in forward (the root's group left unsharded), or in backward after the
    body's weight got its gradient and the head's group reduced (the root's group left
    unsharded with a gradient it never reduced). ``reset_iter_state()`` must drop that
    unreduced gradient: the next full step's gradients are the plain model's alone."""
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = ChunkedHeadModel(DIM, VOCAB)
    reference = copy.deepcopy(model)
    model.body = Raiser(model.body)
    impl.fully_shard([model.norm, model.head])
    impl.fully_shard(model)
    tokens = torch.randint(0, VOCAB, (2, 16), device=rank_ctx.device)
    model.body.armed = point["fails_in"]
    with pytest.raises(RuntimeError, match="boom"):
        if point["fails_in"] == "forward":
            model(tokens, skip_head=True)
        else:
            model(tokens).sum().backward()
    model.body.armed = None
    managed = [m for m in model.modules() if impl.is_managed(m)]
    held = [type(m).__name__ for m in managed if impl.is_group_unsharded(m)]
    assert held, "the failed step left no group unsharded: nothing for the reset to undo"
    model.reset_iter_state()
    # Documented: the reset reshards every parameter group.
    still_held = [type(m).__name__ for m in managed if impl.is_group_unsharded(m)]
    assert not still_held, f"groups of {still_held} are still unsharded after reset_iter_state()"
    # Documented too: the per-iteration trackers are cleared, the modules a group still
    # waited to see run forward among them.
    pending = {type(m).__name__: impl.modules_to_run_forward(m) for m in managed}
    assert not any(pending.values()), (
        f"modules still expected to run forward after reset_iter_state(): {pending}"
    )
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{name} is not a sharded DTensor after reset_iter_state()"
    # The head's group reduced before the failure: its sharded gradients are the caller's to
    # drop, as after any step.
    model.zero_grad(set_to_none=True)
    loss = model(tokens).sum()
    loss.backward()
    ref_loss = reference(tokens).sum()
    ref_loss.backward()
    assert_losses_equal(0, loss, ref_loss)
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient after reset_iter_state()"
    average_gradients(reference)
    assert_sharded_parity(reference, model, prefixes_to_ignore=("inner.",))


def run_double_forward(rank_ctx, impl, raf: bool, checkpoint: str) -> None:
    """Two forwards, one backward of their squared difference; attention, feed-forward, each
    block (checkpointed ``in_place``, by ``utils`` in the model's forward, or ``none``) and
    the root are groups."""
    model: Transformer = transformer(
        3, device=rank_ctx.device, checkpoint_activations=checkpoint == "utils"
    )
    reference = copy.deepcopy(model)
    for layer in model.layers:
        if checkpoint == "in_place":
            checkpoint_in_place(layer)
        impl.fully_shard(layer.attention, reshard_after_forward=raf)
        impl.fully_shard(layer.feed_forward, reshard_after_forward=raf)
        impl.fully_shard(layer, reshard_after_forward=raf)
    impl.fully_shard(model, reshard_after_forward=raf)
    torch.manual_seed(42 + rank_ctx.rank)
    inp1, inp2 = (torch.randint(0, 1024, (2, 32), device=rank_ctx.device) for _ in range(2))
    for m in (model, reference):
        out1, out2 = m(inp1), m(inp2)
        ((out1.sum() - out2.sum()) ** 2).backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name} has no gradient"
    average_gradients(reference)
    rtol, atol = SUMMED_LOGITS_GRAD_TOLERANCE
    assert_sharded_parity(reference, model, rtol=rtol, atol=atol)


@conformance("fsdp.partial.double_forward_nested")
@pytest.mark.parametrize("point", grid(raf=[True, False]))
def test_double_forward_with_nested_fsdp(rank_ctx, impl, point):
    run_double_forward(rank_ctx, impl, point["raf"], "none")


@conformance("fsdp.partial.double_forward_nested_checkpoint")
@pytest.mark.parametrize("point", grid(raf=[True, False], checkpoint=["in_place", "utils"]))
def test_double_forward_with_nested_fsdp_and_checkpoint(rank_ctx, impl, point):
    run_double_forward(rank_ctx, impl, point["raf"], point["checkpoint"])


@conformance("fsdp.partial.double_partial_forward")
def test_double_partial_forward_then_backward(rank_ctx, impl):
    torch.manual_seed(42)
    with torch.device(rank_ctx.device):
        model = ChunkedHeadModel(DIM, VOCAB)
    reference = copy.deepcopy(model)
    impl.fully_shard([model.norm, model.head])
    impl.fully_shard(model)
    torch.manual_seed(42 + rank_ctx.rank)
    t1, t2 = (torch.randint(0, VOCAB, (2, 16), device=rank_ctx.device) for _ in range(2))
    for m in (model, reference):
        h1 = m(t1, skip_head=True)
        h2 = m(t2, skip_head=True)
        (h1.sum() + h2.sum()).backward()
    for p in (model.embed.weight, model.norm.weight):
        assert p.grad is not None and bool(torch.isfinite(local(p.grad)).all())
    assert model.head.weight.grad is None, "the unused head got a gradient"
    average_gradients(reference)
    assert_sharded_parity(reference, model)
