"""The root moves forward inputs to the device; a root with no inputs works."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from distconform.suites.cases import conformance


class ParamlessModule(nn.Module):
    """Checks inside forward that every input, nested ones too (a tuple, a dict keyword), is
    on the rank's device, and that a plain float argument arrives untouched."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.seen: list[torch.device] = []

    def forward(
        self,
        x: torch.Tensor,
        ys: tuple[torch.Tensor, torch.Tensor],
        scale: float,
        *,
        named: dict[str, torch.Tensor],
    ) -> torch.Tensor:
        assert isinstance(scale, float), f"a float argument arrived as {type(scale).__name__}"
        for tensor in (x, *ys, named["z"]):
            self.seen.append(tensor.device)
            assert tensor.device.type == self.device.type, f"input left on {tensor.device}"
            if self.device.index is not None:
                assert tensor.device.index == self.device.index, f"input on {tensor.device}"
        return scale * (x + ys[0] + ys[1]) + named["z"]


def run_move_forward_input(rank_ctx, distribute) -> None:
    device = torch.device(rank_ctx.device)
    model = ParamlessModule(device).to(device)
    assert distribute(model) is model, "the entry point must return the module it was given"
    model.to(device)
    # On the CPU on purpose, whatever the rank's device: the root must move them there.
    x = torch.randn(3, device="cpu")
    ys = (torch.randn(3, device="cpu"), torch.randn(3, device="cpu"))
    named = {"z": torch.randn(3, device="cpu")}
    out = model(x, ys, 2.0, named=named)
    assert len(model.seen) == 4, "forward did not see the tensor, the nested tuple and the dict"
    assert out.device.type == device.type
    torch.testing.assert_close(out.cpu(), 2.0 * (x + ys[0] + ys[1]) + named["z"])


@conformance("fsdp.forward_inputs.move_to_device")
def test_root_move_forward_input_to_device(rank_ctx, impl):
    run_move_forward_input(rank_ctx, impl.fully_shard)


@conformance("replicate.forward_inputs.move_to_device")
def test_replicate_root_move_forward_input_to_device(rank_ctx, impl):
    run_move_forward_input(rank_ctx, impl.replicate)


class ParameterOnlyModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self) -> torch.Tensor:
        return self.weight @ self.weight


@conformance("fsdp.forward_inputs.no_inputs")
def test_root_no_forward_inputs(rank_ctx, impl):
    with torch.device(rank_ctx.device):
        model = ParameterOnlyModule()
    expected = model.weight.detach() @ model.weight.detach()
    impl.fully_shard(model)
    out = model()
    assert out.shape == (4, 4)
    torch.testing.assert_close(out.detach(), expected)
    out.sum().backward()
    assert isinstance(model.weight.grad, DTensor), "the gradient must be a sharded DTensor"
    # d(sum(W @ W))/dW = 1 W^T + W^T 1; every rank has the same W, so the average is that.
    weight = model.weight.full_tensor().detach()
    ones = torch.ones_like(weight)
    torch.testing.assert_close(model.weight.grad.full_tensor(), ones @ weight.T + weight.T @ ones)
