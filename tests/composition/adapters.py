"""Implementations for testing the composition suites, loadable by spec.

* ``tests.composition.adapters:no_grad_average``: torch's FSDP2, except that every group sums
  gradients over the data-parallel group instead of averaging them (divide factor 1). The
  pipeline gradient case must fail on it.
* ``tests.composition.adapters:reference_no_grad_average``: the same fault in the reference,
  whose pipeline stages the suite drives itself (``DataParallelStage``), not torch's engine:
  the gradient case must fail there too.
* ``tests.composition.adapters:reference_claiming_all``: the reference with every capability
  declared, so the composition cases run on it even before it declares ``tp`` / ``pp`` /
  ``dcp``; used to find out what works. Not a conformance claim.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from distconform.impl.api import KNOWN_CAPABILITIES, Implementation, load_implementation
from distconform.impl.torch_adapter import TorchImplementation


class SummingGradients:
    """Mixed in before an implementation: every group it makes sums gradients over the
    data-parallel group instead of averaging them."""

    def fully_shard(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
        return _summing(super().fully_shard(module, **kwargs))

    def replicate(self, module: nn.Module | list[nn.Module], **kwargs: Any) -> Any:
        return _summing(super().replicate(module, **kwargs))


def _summing(managed: Any) -> Any:
    modules = managed if isinstance(managed, list) else [managed]
    # Divide by 1 instead of the data-parallel size: the sum, not the average. A plain SUM
    # reduction, because gloo has no PREMUL_SUM for a custom factor.
    modules[0].set_gradient_divide_factor(1.0)
    modules[0].set_force_sum_reduction_for_comms(True)
    return managed


class NoGradientAverage(SummingGradients, TorchImplementation):
    name = "torch-without-gradient-average"


def no_grad_average() -> Implementation:
    return NoGradientAverage()


def reference_no_grad_average() -> Implementation:
    base = type(load_implementation("reference"))
    summing = type(
        "ReferenceNoGradientAverage",
        (SummingGradients, base),
        {"name": "reference-without-gradient-average", "__module__": __name__},
    )
    return summing()


def reference_claiming_all() -> Implementation:
    reference = type(load_implementation("reference"))()
    reference.name = "reference-claiming-all"
    reference.capabilities = KNOWN_CAPABILITIES
    return reference
