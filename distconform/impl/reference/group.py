"""A parameter group: the parameters of one ``fully_shard``/``replicate`` call and their traffic.

A group's mesh has a *shard* dim, a *replicate* dim, or both (``mesh.py``). ``S`` below is
the shard dim's size (1 for ``replicate``).

Memory layout (``N`` = sum of the padded local shard sizes)::

    sharded_flat    [N]      this rank's padded shards, back to back, in the parameters'
                             original dtype (on the CPU with CPU offload); each sharded
                             DTensor's local tensor is a view into it
    all-gather out  [S * N]  rank-major: shard rank 0's N elements, then rank 1's, ...,
                             in the compute dtype (``param_dtype``) on the compute device
    unsharded_flat  [S * N]  param-major: parameter 0's padded full tensor, then parameter 1's;
                             the unsharded parameters view it; storage freed on reshard

One unshard is one ``all_gather_single`` over the shard dim (of ``sharded_flat``, cast to the
compute dtype and copied to the compute device first when either differs) plus one copy from
rank-major to param-major order (``split_with_sizes_copy``). The copy is unavoidable with more
than one parameter: a full parameter's rows come from every shard rank's slice of the output.
Without an all-gather (``S == 1``: world size 1, ``replicate``) the unsharded parameters alias
``sharded_flat`` directly, unless mixed precision or offload make them a cast/copied
``unsharded_flat`` of ``N`` elements. A user's all-gather (``set_custom_all_gather``) takes the
``all_gather_single``'s place, into a buffer it allocates; likewise a user's reduce-scatter.

One gradient reduction (``_reduce``): the group's gradients, cast to the reduce dtype, laid out
rank-major ``(S, n)``; one ``reduce_scatter_single`` (SUM) over the shard dim when ``S > 1``;
then, with a replicate dim, one ``all_reduce`` (SUM) over it. Sums are divided by the gradient
divide factor (default: the number of data-parallel ranks ``S * R``) locally, since not every
backend has PREMUL_SUM or AVG; the result is cast to the original dtype (and copied to the CPU
with offload) and becomes, or is added to, the sharded ``DTensor`` gradients. With
``set_requires_all_reduce(False)`` the reduce-scattered sums are kept in a partial buffer
instead, added in before the next all-reduce, and no sharded gradient is written.

``reshard_after_forward=k`` (1 < k < S) keeps, between forward and backward, a slice of
``unsharded_flat`` instead of nothing: each parameter's region split into ``k`` pieces, this
rank keeping piece ``shard rank % k``. The backward all-gather then runs within a group of
``k`` consecutive ranks and lands directly in param-major order.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from distconform.impl.reference import collectives, policies
from distconform.impl.reference.mesh import DataParallelMesh
from distconform.impl.reference.param import ManagedParam
from distconform.impl.reference.policies import MixedPrecisionPolicy, OffloadPolicy
from distconform.impl.reference.tensor_parallel import local_data


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
        dp_mesh: DataParallelMesh,
        device: torch.device,
        replicated: bool,
        post_forward_mesh: DeviceMesh | None = None,
        mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 (frozen)
        offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008
    ) -> None:
        _require_one_dtype(params, [p.dtype for p in params])
        self.params = params
        self.mesh = dp_mesh.mesh
        self.shard_size = dp_mesh.shard_size
        self.replicate_size = dp_mesh.replicate_size
        self.shard_group = dp_mesh.group(dp_mesh.shard_dim)
        self.replicate_group = dp_mesh.group(dp_mesh.replicate_dim)
        self.replicated = replicated
        self.device = device
        self.mp_policy = mp_policy
        self.offload_to_cpu = policies.offloads_to_cpu(offload_policy)
        self.pin_memory = policies.pins_memory(offload_policy)
        self.sharded_device = torch.device("cpu") if self.offload_to_cpu else device
        # Policies; the owning state resolves reshard_after_forward at lazy init.
        self.reshard_after_forward = True
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True  # the replicate dim's all-reduce (HSDP, replicate)
        self.unshard_async_op = False
        # set_keep_unsharded_storage: reshard unregisters the unsharded parameters but keeps
        # their storage, so every unshard fills the same memory.
        self.keep_unsharded_storage = False
        self.gradient_divide_factor: float | None = None
        # set_reduce_scatter_unused_params: a parameter without a gradient on this rank takes
        # part in the reduction with zeros, so ranks that used different parameters agree.
        self.reduce_scatter_unused_params = False
        # set_separate_reduce_scatter_group: the reduce-scatters' own group over the shard ranks.
        self.reduce_scatter_group: dist.ProcessGroup | None = None
        # Called with each reduced flat gradient before the division after the sum.
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        # A user's collectives in place of the group's own (collectives.py).
        self.all_gather_comm: collectives.AllGather | None = None
        self.reduce_scatter_comm: collectives.ReduceScatter | None = None
        # Kept for the API: every reduction here is a SUM already (see collectives.py).
        self.force_sum_reduction_for_comms = False
        # Communication in unshard happens only when parameters are split over several ranks.
        self.gathers = self.shard_size > 1

        offset = 0
        for p in params:
            p.flat_offset = offset
            offset += p.flat_numel
        self.flat_numel = offset
        self.sharded_flat = self._new_sharded_flat(params[0].dtype)
        for p, original in zip(params, originals, strict=True):
            p.init_sharded(local_data(original).to(self.sharded_device), self.sharded_flat)

        # reshard_after_forward=k: the (S/k, k) mesh whose dim 1 is this rank's group of k.
        self.post_forward_mesh = post_forward_mesh
        self._post_forward_shard: torch.Tensor | None = None

        self.is_unsharded = False
        self._pending_all_gather: tuple[dist.Work | None, torch.Tensor, torch.Tensor] | None = None
        # Reduce-scattered gradient sums waiting for the replicate all-reduce.
        self._partial_reduce: torch.Tensor | None = None
        # Backward bookkeeping: a group reduces as soon as every gradient it expects has been
        # accumulated; groups with unused parameters are flushed by the final callback.
        self._grads_ready: set[int] = set()
        self._grads_expected = sum(p.requires_grad for p in params)
        self._build_unsharded_params()

    def _new_sharded_flat(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(
            self.flat_numel, dtype=dtype, device=self.sharded_device, pin_memory=self.pin_memory
        )

    def _build_unsharded_params(self) -> None:
        """Resolve the dtypes from the current parameters and (re)create the unsharded params."""
        self.orig_dtype = self.sharded_flat.dtype
        self.compute_dtype = policies.compute_dtype(self.mp_policy, self.orig_dtype)
        self.reduce_dtype = policies.reduce_dtype(self.mp_policy, self.orig_dtype)
        self._flat_numels = [p.flat_numel for p in self.params]
        self._param_major_views: list[torch.Tensor] | None = None  # of this unsharded_flat
        self.aliases_sharded = (
            not self.gathers
            and self.compute_dtype == self.orig_dtype
            and self.sharded_device == self.device
        )
        if self.aliases_sharded:
            self.unsharded_flat = self.sharded_flat
            for p in self.params:
                p.init_unsharded(self.sharded_flat, p.flat_offset)
        else:
            self.unsharded_flat = torch.empty(
                self.shard_size * self.flat_numel, dtype=self.compute_dtype, device=self.device
            )
            for p in self.params:
                p.init_unsharded(self.unsharded_flat, self.shard_size * p.flat_offset)
            self._free_unsharded_storage()
        # The hook refers to this group weakly: a tensor's hooks are invisible to Python's
        # garbage collector, so a strong reference would close a cycle (group -> param ->
        # hook -> group) that is never freed, and with it the model and its mesh's groups.
        on_grad_accumulated = weakref.WeakMethod(self._on_grad_accumulated)
        for index, p in enumerate(self.params):
            assert p.unsharded_param is not None
            # torch refuses the hook on a tensor that needs no gradient, and a parameter frozen
            # before fully_shard may be unfrozen later: register it while requiring one.
            frozen = not p.unsharded_param.requires_grad
            p.unsharded_param.requires_grad_(True)
            p.unsharded_param.register_post_accumulate_grad_hook(
                lambda _param, index=index: on_grad_accumulated()(index)
            )
            p.unsharded_param.requires_grad_(not frozen)
        # state_dict() and load_state_dict() deal in the sharded parameters whatever state the
        # group is in: it reshards first, on every module that registers one of its parameters
        # (so a state dict of any submodule is sharded too). Weakly, for the same reason.
        reshard = weakref.WeakMethod(self.reshard)
        holders = {id(loc.module): loc.module for p in self.params for loc in p.locations}
        for module in holders.values():
            module.register_state_dict_pre_hook(lambda *_: reshard()())
            module.register_load_state_dict_pre_hook(lambda *_: reshard()())

    # --- unshard / reshard -------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start the all-gather (if not already started); unless ``async_op``, finish it."""
        if self.is_unsharded:
            return
        if not self.gathers:
            self._adopt_replaced_sharded_params()
            if not self.aliases_sharded:
                self._allocate_unsharded_storage()
                with torch.no_grad():
                    self.unsharded_flat.copy_(self.sharded_flat)  # cast and/or to the device
            self._register_unsharded()
            return
        if self._pending_all_gather is None:
            self._start_all_gather(async_op)
        if not async_op:
            self.wait_for_unshard()

    def _start_all_gather(self, async_op: bool) -> None:
        self._adopt_replaced_sharded_params()
        if self._post_forward_shard is not None:
            assert self.post_forward_mesh is not None
            source, group = self._post_forward_shard, self.post_forward_mesh.get_group(1)
        else:
            source = self.sharded_flat.to(self.device, self.compute_dtype)
            group = self.shard_group
        work, output = collectives.all_gather_flat(source, group, async_op, self.all_gather_comm)
        # ``source`` may be a temporary cast copy: keep it alive until the all-gather is done.
        self._pending_all_gather = (work, output, source)

    def wait_for_unshard(self) -> None:
        if self._pending_all_gather is None:
            return
        work, output, _source = self._pending_all_gather
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
        if not self.aliases_sharded:
            self._free_unsharded_storage()
        self.is_unsharded = False

    def _register_unsharded(self) -> None:
        for p in self.params:
            p.register_unsharded()
        # Users freeze parameters on the registered (sharded) form between iterations.
        self._grads_expected = sum(p.unsharded_param.requires_grad for p in self.params)
        self.is_unsharded = True

    def _copy_rank_major_to_param_major(self, output: torch.Tensor) -> None:
        ws = self.shard_size
        by_rank = output.view(ws, self.flat_numel)
        with torch.no_grad():
            if all(p.is_dim0_sharded for p in self.params):
                # Param-major regions viewed (S, padded shard) are exactly the padded params.
                torch.split_with_sizes_copy(
                    by_rank, self._flat_numels, dim=1, out=self._param_major_targets()
                )
                return
            for p in self.params:
                # Shard(d > 0): rank r's chunk is a strided slab of the full tensor.
                assert p.layout is not None
                source = by_rank.narrow(1, p.flat_offset, p.flat_numel)
                target = self._param_region(p)
                split = _rank_split_view(p.layout.padded_shape, p.layout.dim, ws)
                target.view(split).transpose(0, 1).copy_(source.view(_rank_major_shape(split)))

    def _param_major_targets(self) -> list[torch.Tensor]:
        """Each parameter's region of ``unsharded_flat`` viewed ``(S, padded shard)``, made once
        per buffer rather than per unshard: views survive the storage being freed and refilled."""
        if self._param_major_views is None:
            ws = self.shard_size
            self._param_major_views = [self._param_region(p).view(ws, -1) for p in self.params]
        return self._param_major_views

    def _param_region(self, p: ManagedParam) -> torch.Tensor:
        """``p``'s padded full tensor inside ``unsharded_flat``, flat."""
        ws = self.shard_size
        return self.unsharded_flat.narrow(0, ws * p.flat_offset, ws * p.flat_numel)

    def _copy_post_forward_gather(self, output: torch.Tensor) -> None:
        assert self.post_forward_mesh is not None
        pieces = self.post_forward_mesh.size(1)
        by_rank = output.view(pieces, -1)
        with torch.no_grad():
            torch.split_with_sizes_copy(
                by_rank,
                [self.shard_size * p.flat_numel // pieces for p in self.params],
                dim=1,
                out=[self._param_region(p).view(pieces, -1) for p in self.params],
            )

    def _allocate_unsharded_storage(self) -> None:
        storage = self.unsharded_flat.untyped_storage()
        nbytes = self.unsharded_flat.numel() * self.unsharded_flat.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def _free_unsharded_storage(self) -> None:
        if self.keep_unsharded_storage:
            return
        self.unsharded_flat.untyped_storage().resize_(0)

    # --- parameters replaced behind the group's back -----------------------------------

    def _adopt_replaced_sharded_params(self) -> None:
        """Re-adopt sharded parameters whose local tensor left ``sharded_flat``.

        ``module.to(dtype)`` (through ``FSDPModule._apply``), ``load_state_dict(assign=True)``
        and the like give a sharded ``DTensor`` parameter a new local tensor; the group then
        rebuilds its buffers around the new tensors, dtype and device included.
        """
        base = self.sharded_flat.untyped_storage().data_ptr()
        if all(p.sharded_local().untyped_storage().data_ptr() == base for p in self.params):
            return
        self.adopt_sharded_params()

    def adopt_sharded_params(self) -> None:
        if self.is_unsharded or self._pending_all_gather is not None:
            raise RuntimeError(
                "the group's sharded parameters changed while it was unsharded; reshard() "
                "before replacing them"
            )
        locals_ = [p.sharded_local() for p in self.params]
        _require_one_dtype(self.params, [t.dtype for t in locals_])
        device = locals_[0].device
        if self.offload_to_cpu and device.type != "cpu":
            raise RuntimeError(
                f"{self.params[0].fqn} is on {device}, but with CPUOffloadPolicy the sharded "
                f"parameters must stay on the CPU"
            )
        self.sharded_device = device
        self._post_forward_shard = None
        flat = self._new_sharded_flat(locals_[0].dtype)
        for p, local in zip(self.params, locals_, strict=True):
            p.adopt_sharded(local, flat)
        self.sharded_flat = flat
        self._build_unsharded_params()

    # --- backward ----------------------------------------------------------------------

    def _on_grad_accumulated(self, index: int) -> None:
        self._grads_ready.add(index)
        if len(self._grads_ready) >= self._grads_expected:
            # A frozen parameter's last use in backward (the gradient of its input) may still
            # be ahead when the trainable ones' gradients are complete: the reduction can go,
            # the reshard waits for the end of backward, which reshards every group.
            self.post_backward(reshard=not self._holds_frozen_params())

    def _holds_frozen_params(self) -> bool:
        return any(not p.unsharded_param.requires_grad for p in self.params)

    def post_backward(self, *, reshard: bool = True) -> None:
        """Reduce the accumulated gradients (if syncing) and reshard (if asked to, and if
        ``reshard``)."""
        self._grads_ready.clear()
        if self.requires_gradient_sync:
            self._reduce_gradients()
        else:
            for p in self.params:
                p.stash_unsharded_grad(self.reduce_dtype)
        if reshard and self.reshard_after_backward:
            self.reshard()

    def _reduce_gradients(self) -> None:
        with_grads = [(p, g) for p in self.params if (g := self._gradient_to_reduce(p)) is not None]
        if not with_grads:
            return
        with torch.no_grad():
            reduced = self._reduce(with_grads)
            if reduced is None:
                return
            offset = 0
            for p, _ in with_grads:
                p.accumulate_sharded_grad(_local_rows(p, reduced.narrow(0, offset, p.flat_numel)))
                offset += p.flat_numel

    def _gradient_to_reduce(self, p: ManagedParam) -> torch.Tensor | None:
        grad = p.take_unsharded_grad()
        if grad is None and self.reduce_scatter_unused_params and p.requires_grad:
            assert p.unsharded_param is not None
            return torch.zeros(p.shape, dtype=p.unsharded_param.dtype, device=self.device)
        return grad

    def _reduce(self, with_grads: list[tuple[ManagedParam, torch.Tensor]]) -> torch.Tensor | None:
        """This rank's reduced rows of every gradient, flat, or ``None`` if held back as partial."""
        dtype = self.reduce_dtype or with_grads[0][1].dtype
        factor = self.gradient_divide_factor or self.shard_size * self.replicate_size
        pre_divide, post_divide = policies.gradient_divide_factors(factor, dtype)
        rank_major = torch.cat(
            [_grad_rank_major(p, g.to(dtype), self.shard_size) for p, g in with_grads], dim=1
        )
        if pre_divide != 1:
            rank_major.div_(pre_divide)
        if self.shard_size > 1:
            group = self.reduce_scatter_group or self.shard_group
            reduced = collectives.reduce_scatter_sum(rank_major, group, self.reduce_scatter_comm)
        else:
            reduced = rank_major[0]
        if self.replicate_group is not None:
            if self._partial_reduce is not None:
                if self._partial_reduce.shape != reduced.shape:
                    raise RuntimeError(
                        "set_requires_all_reduce(False): a later backward produced gradients for "
                        "a different set of parameters than the one it accumulates with"
                    )
                reduced += self._partial_reduce
                self._partial_reduce = None
            if not self.requires_all_reduce:
                self._partial_reduce = reduced
                return None
            if self.replicate_size > 1:
                collectives.all_reduce_sum(reduced, self.replicate_group)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(reduced)
        if post_divide != 1:
            reduced.div_(post_divide)
        return reduced.to(self.sharded_device, self.orig_dtype)

    def reset(self) -> None:
        """Forget a failed iteration: drop pending work and unsharded grads, reshard."""
        self._grads_ready.clear()
        self._partial_reduce = None
        for p in self.params:
            p.take_unsharded_grad()
        self.reshard()


def _require_one_dtype(params: list[ManagedParam], dtypes: list[torch.dtype]) -> None:
    if len(set(dtypes)) != 1:
        names = ", ".join(f"{p.fqn}: {d}" for p, d in zip(params, dtypes, strict=True))
        raise NotImplementedError(
            f"the reference keeps one flat buffer per group, so all parameters of a group "
            f"must share a dtype; got {names}"
        )


def _local_rows(p: ManagedParam, flat: torch.Tensor) -> torch.Tensor:
    """``p``'s padded flat shard viewed in its shape, padding rows cut off."""
    if p.layout is None:
        return flat.view(p.shape)
    return flat.view(p.layout.padded_local_shape).narrow(p.layout.dim, 0, p.layout.local_rows)


def _grad_rank_major(p: ManagedParam, grad: torch.Tensor, ws: int) -> torch.Tensor:
    """``grad`` reshaped to ``(S, padded shard numel)``: row r is what shard rank r will own."""
    layout = p.layout
    if layout is None:
        return grad.reshape(1, -1)
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
    """``shape`` as ``(before dim, S, chunk, after dim)``: splits dim ``dim`` into rank chunks."""
    before = math.prod(shape[:dim])
    after = math.prod(shape[dim + 1 :])
    return (before, ws, shape[dim] // ws, after)


def _rank_major_shape(split: tuple[int, ...]) -> tuple[int, ...]:
    before, ws, chunk, after = split
    return (ws, before, chunk, after)
