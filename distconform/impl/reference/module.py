"""The ``FSDPModule`` mixin: the methods a managed module gains (FSDP2's names and signatures).

``fully_shard`` swaps a module's class for ``FSDP<Class>(FSDPModule, <Class>)``; ``replicate``
uses ``Replicate<Class>(ReplicateModule, <Class>)``. The mixin holds no data: every method
looks up the module's ``FSDPState``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from distconform.impl.reference import collectives
from distconform.impl.reference.group import UnshardHandle
from distconform.impl.reference.state import GradientReductionHandle, state_of

if TYPE_CHECKING:
    from distconform.impl.reference.state import FSDPState


class FSDPModule:
    def _fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        if state is None:
            raise AssertionError(f"{type(self).__name__} has an FSDP class but no FSDP state")
        return state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._fsdp_state()]
        seen: dict[int, FSDPState] = {}
        for module in self.modules():  # type: ignore[attr-defined]
            state = state_of(module)
            if state is not None:
                seen.setdefault(id(state), state)
        return list(seen.values())

    # --- explicit unshard / reshard ----------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's group now; with ``async_op`` return a handle to wait on."""
        group = self._fsdp_state().group
        if group is None:
            return UnshardHandle(None) if async_op else None
        group.unshard(async_op=async_op)
        if async_op:
            return UnshardHandle(group)
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ``DTensor``s again."""
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()

    def reset_iter_state(self) -> None:
        """Recover from an exception mid-iteration: reshard everything, clear pending state."""
        self._fsdp_state().reset_iter_state()

    # --- flags -------------------------------------------------------------------------

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """With ``False``, backward accumulates unsharded gradients and communicates nothing."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP only (issue 6): on a 1-D mesh there is no replicate all-reduce to skip."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        for state in self._fsdp_states(recurse):
            if state.group is not None and not state.replicated:
                state.group.reshard_after_forward = reshard_after_forward
                state.group.post_forward_mesh = None  # a bool means all or nothing
                # Called before the first forward, it must outlive lazy init's defaults.
                state.requested_reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """``False``: stay unsharded after backward, so the next forward skips its all-gather."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        # Reductions are waited for inline, so nothing is deferred to the last backward.
        self._fsdp_state().ctx.is_last_backward = is_last_backward

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root, before backward: the caller ends each backward with
        :meth:`finalize_backward` instead of the end of autograd's pass doing it."""
        state = self._fsdp_state()
        if state.is_root is False:
            raise RuntimeError("set_manual_backward_finalization must be called on the root")
        if state.ctx.in_backward:
            raise RuntimeError("set_manual_backward_finalization cannot change mode in backward")
        state.ctx.manual_backward_finalization = enabled

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """Finish the backward(s) since the last finalization: reduce what is unreduced (with
        gradient sync as it is now) and reshard. A no-op before the root's first forward."""
        state = self._fsdp_state()
        if state.is_root is not None:
            if not state.is_root:
                raise RuntimeError("finalize_backward must be called on the root")
            if not state.ctx.manual_backward_finalization:
                raise RuntimeError(
                    "finalize_backward requires manual backward finalization: call "
                    "set_manual_backward_finalization(True) on the root before forward"
                )
            state.ctx.finalize_backward()
        return GradientReductionHandle() if async_op else None

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Keep the unsharded parameters' storage through reshards (the same data pointers
        on every unshard, for CUDA graph capture), at the cost of holding that memory."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.keep_unsharded_storage = keep

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False`` for modules whose backward does not read their parameters (embeddings)."""
        self._fsdp_state().unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        self._fsdp_state().forward_prefetch = [_state_of_managed(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: Iterable[nn.Module]) -> None:
        self._fsdp_state().backward_prefetch = [_state_of_managed(m) for m in modules]

    def set_post_optim_event(self, event: Any) -> None:
        """The root's next forward waits for ``event`` (recorded after the optimizer step,
        on any stream) before its first all-gather; later forwards do not (it is used once)."""
        self._fsdp_state().post_optim_event = event

    # --- gradient reduction (this module's group only, like FSDP2) -----------------------

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the number of data-parallel ranks."""
        group = self._fsdp_state().group
        if group is not None:
            group.gradient_divide_factor = factor

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name for :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook`` with each reduced gradient of this module's group: the flat tensor of
        this rank's padded rows, in the reduce dtype, after the last reduction (reduce-scatter,
        or the all-reduce on an HSDP mesh) and before the division after the sum; what it
        writes there is the gradient. ``stream`` is accepted for FSDP2's signature: the
        reference runs the hook where it reduces."""
        group = self._fsdp_state().group
        if group is not None:
            group.all_reduce_hook = hook

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce zeros for parameters that got no gradient on this rank (different ranks using
        different parameters), so every rank issues the same reduce-scatter."""
        for state in self._fsdp_states(recurse):
            if state.group is not None:
                state.group.reduce_scatter_unused_params = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reduce-scatter input buffers may be in flight: a memory/overlap dial for
        asynchronous reduce-scatters. The reference reduces synchronously, one buffer at a time,
        so any cap holds; it is still checked (an int of at least 1, not a bool)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be at least 1, got {max_input_buffers}")

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run the gradient reduce-scatters on a group of their own over the same shard ranks
        (one per distinct set of ranks), so they may overlap the all-gathers; ``False`` goes
        back to the shard group. Collective: every shard rank calls it in the same order."""
        groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for state in self._fsdp_states(recurse):
            group = state.group
            if group is None or group.shard_size == 1:
                continue
            if not enable:
                group.reduce_scatter_group = None
                continue
            ranks = tuple(dist.get_process_group_ranks(group.shard_group))
            if ranks not in groups:
                groups[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
            group.reduce_scatter_group = groups[ranks]

    def set_custom_all_gather(self, comm: collectives.AllGather) -> None:
        """Every all-gather of this module's group runs ``comm``: into a buffer from its
        ``allocate``, and what it leaves there is the unsharded parameters' data."""
        group = self._fsdp_state().group
        if group is not None:
            group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm: collectives.ReduceScatter) -> None:
        """Every reduce-scatter of this module's group runs ``comm``, with ``op=SUM`` (the
        reference divides locally), between buffers from its ``allocate``."""
        group = self._fsdp_state().group
        if group is not None:
            group.reduce_scatter_comm = comm

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Accepted for FSDP2's API; the reference always reduces with SUM and divides locally."""
        group = self._fsdp_state().group
        if group is not None:
            group.force_sum_reduction_for_comms = enable

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # module.to(dtype/device) converts whatever is registered: make that the sharded
        # DTensors, then rebuild the group's buffers around their new local tensors.
        group = self._fsdp_state().group
        if group is not None:
            group.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        if group is not None:
            group.adopt_sharded_params()
        return result


class ReplicateModule(FSDPModule):
    """The mixin ``replicate`` uses; same methods, distinguishable by ``isinstance``."""


def _state_of_managed(module: nn.Module) -> FSDPState:
    state = state_of(module)
    if state is None:
        raise ValueError(f"{type(module).__name__} is not managed by fully_shard or replicate")
    return state
