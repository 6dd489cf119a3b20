"""A parameter group: the parameters of one ``fully_shard``/``replicate`` call and their traffic.

Memory layout (``N`` = sum of the padded local shard sizes, ``W`` = world size)::

    sharded_flat    [N]      this rank's padded shards, back to back; each sharded DTensor's
                             local tensor is a view into it, so it *is* the all-gather input
    all-gather out  [W * N]  rank-major: rank 0's N elements, then rank 1's, ...
    unsharded_flat  [W * N]  param-major: parameter 0's padded full tensor, then parameter 1's;
                             the unsharded parameters view it; storage freed on reshard

One unshard is one ``all_gather_single`` plus one copy from rank-major to param-major order
(``split_with_sizes_copy``). The copy is unavoidable with more than one parameter: a full
parameter's rows come from every rank's slice of the output, so it cannot be a view of it.

One gradient reduction is one ``reduce_scatter_single`` of the gradients laid out rank-major
(sharded groups) or one ``all_reduce`` of the flattened gradients (replicated groups).
Without collectives (world size 1, or replicate) the unsharded parameters alias the sharded
storage directly: no copies at all.

``reshard_after_forward=k`` (1 < k < W) keeps, between forward and backward, a slice of
``unsharded_flat`` instead of nothing: each parameter's region split into ``k`` pieces, this
rank keeping piece ``rank % k``. The backward all-gather then runs within a group of ``k``
consecutive ranks and lands directly in param-major order.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from impl.reference import collectives
from impl.reference.param import ManagedParam


class UnshardHandle:
    """Returned by ``unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class ParamGroup:
    def __init__(
        self,
        params: list[ManagedParam],
        originals: list[nn.Parameter],
        mesh: DeviceMesh,
        device: torch.device,
        replicated: bool,
        post_forward_mesh: DeviceMesh | None = None,
    ) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            names = ", ".join(f"{p.fqn}: {p.dtype}" for p in params)
            raise NotImplementedError(
                f"the reference keeps one flat buffer per group, so all parameters of a group "
                f"must share a dtype; got {names}"
            )
        self.params = params
        self.mesh = mesh
        self.process_group = mesh.get_group()
        self.world_size = mesh.size()
        self.replicated = replicated
        self.device = device
        # Policies; the owning state resolves reshard_after_forward at lazy init.
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # HSDP's replicate-dim all-reduce (issue 6)
        self.unshard_async_op = False
        # Communication happens only for sharded groups spanning more than one rank.
        self.gathers = not replicated and self.world_size > 1

        offset = 0
        for p in params:
            p.flat_offset = offset
            offset += p.flat_numel
        self.flat_numel = offset
        dtype = params[0].dtype
        self.sharded_flat = torch.zeros(self.flat_numel, dtype=dtype, device=device)
        for p, original in zip(params, originals, strict=True):
            p.init_sharded(original.detach().to(device), self.sharded_flat)

        if self.gathers:
            self.unsharded_flat = torch.empty(
                self.world_size * self.flat_numel, dtype=dtype, device=device
            )
            for p in params:
                p.init_unsharded(self.unsharded_flat, self.world_size * p.flat_offset)
            self._free_unsharded_storage()
        else:
            for p in params:
                p.init_unsharded(self.sharded_flat, p.flat_offset)

        # reshard_after_forward=k: the (W/k, k) mesh whose dim 1 is this rank's group of k.
        self.post_forward_mesh = post_forward_mesh
        self._post_forward_shard: torch.Tensor | None = None

        self.is_unsharded = False
        self._pending_all_gather: tuple[torch.distributed.Work | None, torch.Tensor] | None = None
        # Backward bookkeeping: a group reduces as soon as every gradient it expects has been
        # accumulated; groups with unused parameters are flushed by the final callback.
        self._grads_ready: set[int] = set()
        self._grads_expected = sum(p.requires_grad for p in params)
        for index, p in enumerate(params):
            assert p.unsharded_param is not None
            p.unsharded_param.register_post_accumulate_grad_hook(
                lambda _param, index=index: self._on_grad_accumulated(index)
            )

    # --- unshard / reshard -------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (if not already started); unless ``async_op``, finish it."""
        if self.is_unsharded:
            return
        if not self.gathers:
            self._check_sharded_storage()
            self._register_unsharded()
            return
        if self._pending_all_gather is None:
            self._start_all_gather(async_op)
        if not async_op:
            self.wait_for_unshard()

    def _start_all_gather(self, async_op: bool) -> None:
        self._check_sharded_storage()
        source, group = self.sharded_flat, self.process_group
        if self._post_forward_shard is not None:
            assert self.post_forward_mesh is not None
            source, group = self._post_forward_shard, self.post_forward_mesh.get_group(1)
        output = source.new_empty(self.world_size * self.flat_numel)
        work = collectives.all_gather_flat(output, source, group, async_op)
        self._pending_all_gather = (work, output)

    def wait_for_unshard(self) -> None:
        if self._pending_all_gather is None:
            return
        work, output = self._pending_all_gather
        self._pending_all_gather = None
        if work is not None:
            work.wait()
        self._allocate_unsharded_storage()
        if self._post_forward_shard is not None:
            self._copy_post_forward_gather(output)
            self._post_forward_shard = None
        else:
            self._copy_rank_major_to_param_major(output)
        self._register_unsharded()

    def reshard_after_forward_step(self) -> None:
        """What post-forward does: nothing, a full reshard, or a reshard to groups of k."""
        if not self.reshard_after_forward:
            return
        if self.post_forward_mesh is None or not self.gathers:
            self.reshard()
            return
        self.wait_for_unshard()
        if not self.is_unsharded:
            return
        pieces, piece = self.post_forward_mesh.size(1), self.post_forward_mesh.get_local_rank(1)
        self._post_forward_shard = torch.cat(
            [self._param_region(p).view(pieces, -1)[piece] for p in self.params]
        )
        self._reshard_to_sharded()

    def reshard(self) -> None:
        self.wait_for_unshard()
        self._post_forward_shard = None
        if not self.is_unsharded:
            return
        self._reshard_to_sharded()

    def _reshard_to_sharded(self) -> None:
        for p in self.params:
            p.register_sharded()
        if self.gathers:
            self._free_unsharded_storage()
        self.is_unsharded = False

    def _register_unsharded(self) -> None:
        for p in self.params:
            p.register_unsharded()
        # Users freeze parameters on the registered (sharded) form between iterations.
        self._grads_expected = sum(p.unsharded_param.requires_grad for p in self.params)
        self.is_unsharded = True

    def _copy_rank_major_to_param_major(self, output: torch.Tensor) -> None:
        ws = self.world_size
        by_rank = output.view(ws, self.flat_numel)
        with torch.no_grad():
            if all(p.is_dim0_sharded for p in self.params):
                # Param-major regions viewed (W, padded shard) are exactly the padded params.
                targets = [self._param_region(p).view(ws, -1) for p in self.params]
                torch.split_with_sizes_copy(
                    by_rank, [p.flat_numel for p in self.params], dim=1, out=targets
                )
                return
            for p in self.params:
                # Shard(d > 0): rank r's chunk is a strided slab of the full tensor.
                assert p.layout is not None
                source = by_rank.narrow(1, p.flat_offset, p.flat_numel)
                target = self._param_region(p)
                split = _rank_split_view(p.layout.padded_shape, p.layout.dim, ws)
                target.view(split).transpose(0, 1).copy_(source.view(_rank_major_shape(split)))

    def _param_region(self, p: ManagedParam) -> torch.Tensor:
        """``p``'s padded full tensor inside ``unsharded_flat``, flat."""
        ws = self.world_size
        return self.unsharded_flat.narrow(0, ws * p.flat_offset, ws * p.flat_numel)

    def _copy_post_forward_gather(self, output: torch.Tensor) -> None:
        assert self.post_forward_mesh is not None
        pieces = self.post_forward_mesh.size(1)
        by_rank = output.view(pieces, -1)
        with torch.no_grad():
            torch.split_with_sizes_copy(
                by_rank,
                [self.world_size * p.flat_numel // pieces for p in self.params],
                dim=1,
                out=[self._param_region(p).view(pieces, -1) for p in self.params],
            )

    def _allocate_unsharded_storage(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded_storage(self) -> None:
        self.unsharded_flat.untyped_storage().resize_(0)

    def _check_sharded_storage(self) -> None:
        """Fail loudly if something replaced a sharded parameter's storage behind our back."""
        base = self.sharded_flat.untyped_storage().data_ptr()
        for p in self.params:
            if p.sharded_local().untyped_storage().data_ptr() != base:
                raise RuntimeError(
                    f"{p.fqn}: the sharded parameter's local tensor no longer lives in its "
                    f"group's flat buffer (was it replaced, e.g. by module.to(dtype)?); the "
                    f"reference does not support re-materialised parameters yet (issue 6)"
                )

    # --- backward ----------------------------------------------------------------------

    def _on_grad_accumulated(self, index: int) -> None:
        self._grads_ready.add(index)
        if len(self._grads_ready) >= self._grads_expected:
            self.post_backward()

    def post_backward(self) -> None:
        """Reduce the accumulated gradients (if syncing) and reshard (if asked to)."""
        self._grads_ready.clear()
        if self.requires_gradient_sync:
            self._reduce_gradients()
        if self.reshard_after_backward:
            self.reshard()

    def _reduce_gradients(self) -> None:
        with_grads = [(p, g) for p in self.params if (g := p.take_unsharded_grad()) is not None]
        if not with_grads:
            return
        with torch.no_grad():
            if self.replicated:
                self._all_reduce(with_grads)
            elif self.gathers:
                self._reduce_scatter(with_grads)
            else:
                for p, grad in with_grads:
                    p.accumulate_sharded_grad(grad)

    def _reduce_scatter(self, with_grads: list[tuple[ManagedParam, torch.Tensor]]) -> None:
        ws = self.world_size
        rank_major = torch.cat([_grad_rank_major(p, g, ws) for p, g in with_grads], dim=1)
        reduced = collectives.reduce_scatter_mean(rank_major, self.process_group)
        offset = 0
        for p, _ in with_grads:
            assert p.layout is not None
            local = reduced.narrow(0, offset, p.flat_numel).view(p.layout.padded_local_shape)
            p.accumulate_sharded_grad(local.narrow(p.layout.dim, 0, p.layout.local_rows))
            offset += p.flat_numel

    def _all_reduce(self, with_grads: list[tuple[ManagedParam, torch.Tensor]]) -> None:
        if self.world_size == 1:
            for p, grad in with_grads:
                p.accumulate_sharded_grad(grad)
            return
        flat = torch.cat([g.reshape(-1) for _, g in with_grads])
        collectives.all_reduce_mean(flat, self.process_group)
        offset = 0
        for p, grad in with_grads:
            p.accumulate_sharded_grad(flat.narrow(0, offset, grad.numel()).view(p.shape))
            offset += grad.numel()

    def reset(self) -> None:
        """Forget a failed iteration: drop pending work and unsharded grads, reshard."""
        self._grads_ready.clear()
        for p in self.params:
            p.take_unsharded_grad()
        self.reshard()


def _grad_rank_major(p: ManagedParam, grad: torch.Tensor, ws: int) -> torch.Tensor:
    """``grad`` reshaped to ``(W, padded shard numel)``: row r is what rank r will own."""
    assert p.layout is not None
    layout = p.layout
    if layout.dim == 0:
        if layout.padded_shape[0] != layout.shape[0]:
            padded = grad.new_zeros(layout.padded_shape)
            padded.narrow(0, 0, layout.shape[0]).copy_(grad)
            grad = padded
        return grad.reshape(ws, -1)
    return (
        grad.reshape(_rank_split_view(layout.padded_shape, layout.dim, ws))
        .transpose(0, 1)
        .reshape(ws, -1)
    )


def _rank_split_view(shape: tuple[int, ...], dim: int, ws: int) -> tuple[int, ...]:
    """``shape`` as ``(before dim, W, chunk, after dim)``: splits dim ``dim`` into rank chunks."""
    before = math.prod(shape[:dim])
    after = math.prod(shape[dim + 1 :])
    return (before, ws, shape[dim] // ws, after)


def _rank_major_shape(split: tuple[int, ...]) -> tuple[int, ...]:
    before, ws, chunk, after = split
    return (ws, before, chunk, after)
