"""One managed parameter: where it is registered, its sharded ``DTensor`` and its unsharded alias.

A managed parameter lives in two forms that are swapped in and out of its modules:

* the **sharded** form, an ``nn.Parameter`` holding a ``DTensor`` whose local tensor is a view
  into the parameter group's flat sharded buffer (so the all-gather reads it with no copy-in,
  and the optimizer's in-place updates land in that buffer). Its placements are one per mesh
  dim: ``(Shard(d),)`` on a 1-D mesh, ``(Replicate(), Shard(d))`` on an HSDP mesh
  ``(replicate, shard)``, ``(Replicate(),)`` for ``replicate``. It keeps the parameter's
  original dtype and, with CPU offload, lives on the CPU;
* the **unsharded** form, an ``nn.Parameter`` that views the group's unsharded buffer (for a
  tensor-parallel parameter, through a ``DTensor`` on the TP mesh), in the compute dtype
  (``MixedPrecisionPolicy.param_dtype``) on the compute device. It is created once and reused
  for every unshard, so autograd's saved tensors and the gradients accumulated on it across
  microbatches survive a reshard/unshard cycle.

A parameter that is already a tensor-parallel ``DTensor`` is managed through its local tensor
(``impl/reference/tensor_parallel.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Shard

from distconform.impl import _torch_private
from distconform.impl.reference.mesh import DataParallelMesh
from distconform.impl.reference.sharding import ShardLayout
from distconform.impl.reference.tensor_parallel import ModelParallelSpec, local_data, sharded_layout

_DTensorFactory = tuple[torch.dtype, Callable[[torch.Tensor], DTensor]]


@dataclass(frozen=True)
class ParamLocation:
    """One place a parameter is registered; tied weights have several."""

    module: nn.Module
    name: str


def alias_storage(storage_owner: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A contiguous tensor on ``storage_owner``'s storage with its own version counter."""
    alias = torch.empty(0, dtype=storage_owner.dtype, device=storage_owner.device)
    stride = torch.empty(shape, device="meta").stride()
    return alias.set_(
        storage_owner.untyped_storage(),
        storage_owner.storage_offset() + offset,
        shape,
        stride,
    )


class ManagedParam:
    """A parameter of a group: its placements, its sharded storage and its registration.

    ``placement`` says how the parameter is split over the shard dim of ``dp_mesh``
    (``Shard(d)``) or that it is not split at all (``Replicate()``). ``mesh`` and
    ``placements`` are those of the sharded ``DTensor``: the data-parallel ones, followed by
    the model-parallel ones for a TP parameter (or, with ``dp_mesh_dims``, the parameter's own
    with the shard dim's replaced). ``shape`` is the shape of what is sharded (for a
    ``DTensor``: its local tensor), ``global_shape`` the parameter's shape.
    """

    def __init__(
        self,
        fqn: str,
        original: nn.Parameter,
        locations: list[ParamLocation],
        dp_mesh: DataParallelMesh,
        placement: Placement,
    ) -> None:
        self.fqn = fqn
        self.locations = locations
        # How the data-parallel shard dim splits the parameter: Shard(d) or Replicate().
        self.placement = placement
        self.model_parallel = ModelParallelSpec.of(original, dp_mesh)
        self.mesh, self.placements = sharded_layout(dp_mesh, placement, self.model_parallel)
        shard_size, shard_rank = dp_mesh.shard_size, dp_mesh.shard_rank
        self.shape = local_data(original).shape
        self.dtype = original.dtype
        self.requires_grad = original.requires_grad
        self.global_shape = original.shape
        # Computed once: every sharded gradient (one per step) needs the global stride.
        self.global_stride = torch.empty(self.global_shape, device="meta").stride()
        # DTensor constructors by dtype, built once (see _torch_private.dtensor_factory).
        self._factory: _DTensorFactory | None = None
        self._unsharded_factory: _DTensorFactory | None = None
        if isinstance(self.placement, Shard):
            self.layout: ShardLayout | None = ShardLayout(
                tuple(self.shape), self.placement.dim, shard_size, shard_rank
            )
            self.flat_numel = self.layout.padded_local_numel
        else:
            self.layout = None
            self.flat_numel = self.shape.numel()
        # Set by ParamGroup once the flat buffers exist.
        self.flat_offset = 0
        self.sharded_param: nn.Parameter
        self.unsharded_param: nn.Parameter | None = None
        # Unsharded gradients kept in the reduce dtype while gradient sync is off (FSDP2
        # accumulates in reduce_dtype when it differs from the compute dtype).
        self.accumulated_grad: torch.Tensor | None = None

    @property
    def is_dim0_sharded(self) -> bool:
        return self.layout is not None and self.layout.dim == 0

    # --- sharded form ------------------------------------------------------------------

    def local_view(self, sharded_flat: torch.Tensor) -> torch.Tensor:
        """This rank's real rows inside the group's flat sharded buffer (padding excluded)."""
        region = sharded_flat.narrow(0, self.flat_offset, self.flat_numel)
        if self.layout is None:
            return region.view(self.shape)
        # Trimming a padded leading dim keeps the view contiguous; other dims are never padded.
        return region.view(self.layout.padded_local_shape).narrow(
            self.layout.dim, 0, self.layout.local_rows
        )

    def init_sharded(self, full: torch.Tensor, sharded_flat: torch.Tensor) -> None:
        """Copy this rank's shard of ``full`` into the flat buffer and register it as a DTensor."""
        local = self.local_view(sharded_flat)
        with torch.no_grad():
            if self.layout is None:
                local.copy_(full)
            else:
                local.copy_(
                    full.narrow(self.layout.dim, self.layout.row_offset, self.layout.local_rows)
                )
        self.sharded_param = nn.Parameter(self._as_dtensor(local), requires_grad=self.requires_grad)
        self.register(self.sharded_param)

    def adopt_sharded(self, local: torch.Tensor, sharded_flat: torch.Tensor) -> None:
        """Move ``local`` (the sharded parameter's current real rows, possibly of a new dtype or
        storage, e.g. after ``module.to(float64)``) into ``sharded_flat``, keeping the
        parameter object (optimizers and users hold it) and its gradient."""
        view = self.local_view(sharded_flat)
        with torch.no_grad():
            view.copy_(local)
        param = self.sharded_param
        grad = param.grad
        replacement = nn.Parameter(self._as_dtensor(view), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, replacement)
        param.grad = grad
        self.dtype = sharded_flat.dtype

    def _as_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` (a shard of the parameter or of its gradient) as a ``DTensor`` placed like
        the sharded parameter, on ``local``'s own device.

        Not ``DTensor.from_local``: it moves ``local`` to the mesh's device type, so a shard
        offloaded to the CPU (CPUOffloadPolicy on a cuda mesh) became a copy on the
        accelerator, outside ``sharded_flat`` (seen on an H100); and its autograd node, made
        for every parameter's gradient every step, cost 15x the bare constructor.
        """
        if self._factory is None or self._factory[0] != local.dtype:
            factory = _torch_private.dtensor_factory(
                self.mesh, self.placements, self.global_shape, self.global_stride, local.dtype
            )
            self._factory = (local.dtype, factory)
        return self._factory[1](local)

    def sharded_local(self) -> torch.Tensor:
        """The sharded parameter's current local tensor (``module.to`` may have swapped it)."""
        with torch.no_grad():
            return self.sharded_param.to_local()

    # --- unsharded form ----------------------------------------------------------------

    def init_unsharded(self, storage_owner: torch.Tensor, offset: int) -> nn.Parameter:
        """Create the unsharded parameter on ``storage_owner``'s storage (its dtype and device).

        A gradient accumulated on a previous unsharded parameter (gradient sync off across a
        re-materialisation) is carried over.
        """
        previous = self.unsharded_param
        alias = alias_storage(storage_owner, offset, self.shape)
        data = alias if self.model_parallel is None else self._as_model_parallel(alias)
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)
        if previous is not None and previous.grad is not None:
            self.unsharded_param.grad = previous.grad.to(alias.dtype)
        return self.unsharded_param

    def _as_model_parallel(self, local: torch.Tensor) -> DTensor:
        """``local`` as the TP ``DTensor`` the module was parallelised with."""
        spec = self.model_parallel
        assert spec is not None
        if self._unsharded_factory is None or self._unsharded_factory[0] != local.dtype:
            factory = _torch_private.dtensor_factory(
                spec.mesh, spec.placements, spec.shape, spec.stride, local.dtype
            )
            self._unsharded_factory = (local.dtype, factory)
        return self._unsharded_factory[1](local)

    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """An unsharded gradient as a plain tensor shaped like ``self.shape``."""
        if self.model_parallel is None:
            return grad
        return self.model_parallel.local_grad(grad)

    # --- registration ------------------------------------------------------------------

    def register(self, param: nn.Parameter) -> None:
        for loc in self.locations:
            # register_parameter replaces the entry in place, keeping the module's param order.
            loc.module.register_parameter(loc.name, param)

    def register_sharded(self) -> None:
        self.register(self.sharded_param)

    def register_unsharded(self) -> None:
        if self.unsharded_param is None:
            raise AssertionError(f"{self.fqn}: unsharded parameter used before init_unsharded")
        # Freezing is done by users on the registered (sharded) parameter; mirror it.
        self.unsharded_param.requires_grad_(self.sharded_param.requires_grad)
        self.register(self.unsharded_param)

    # --- gradients ---------------------------------------------------------------------

    def stash_unsharded_grad(self, reduce_dtype: torch.dtype | None) -> None:
        """Gradient sync is off: keep accumulating, in ``reduce_dtype`` when one is set."""
        if self.unsharded_param is None or self.unsharded_param.grad is None:
            return
        grad = self.unsharded_param.grad
        if self.accumulated_grad is not None:
            self.accumulated_grad += self._local_grad(grad)
            self.unsharded_param.grad = None
        elif reduce_dtype is not None and grad.dtype != reduce_dtype:
            self.accumulated_grad = self._local_grad(grad).to(reduce_dtype)
            self.unsharded_param.grad = None

    def take_unsharded_grad(self) -> torch.Tensor | None:
        """Detach the accumulated unsharded gradient (both kinds) from this parameter."""
        if self.unsharded_param is None:
            return None
        grad = self.unsharded_param.grad
        self.unsharded_param.grad = None
        if grad is not None:
            grad = self._local_grad(grad)
        accumulated, self.accumulated_grad = self.accumulated_grad, None
        if accumulated is None:
            return grad
        if grad is not None:
            accumulated += grad
        return accumulated

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Set or add ``local_grad`` (this rank's real rows) as the sharded gradient."""
        existing = self.sharded_param.grad
        if existing is None:
            self.sharded_param.grad = self._as_dtensor(local_grad)
            return
        with torch.no_grad():
            existing.to_local().add_(local_grad)
