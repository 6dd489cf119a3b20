"""``impl/_torch_private.py``'s activation-checkpointing accessor: version-checked and working."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from impl import _torch_private


def test_checkpoint_wrapper_api_refuses_an_unaudited_torch(monkeypatch):
    monkeypatch.setattr(_torch_private, "installed_torch_version", lambda: (9, 99))
    with pytest.raises(_torch_private.PrivateTorchAccessError, match="checkpoint_wrapper_api"):
        _torch_private.checkpoint_wrapper_api()


def test_checkpoint_wrapper_api_wraps_with_its_prefix_and_keeps_gradients():
    _wrapper, apply_activation_checkpointing, prefix = _torch_private.checkpoint_wrapper_api()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain = copy.deepcopy(model)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
    names = [name for name, _ in model.named_parameters()]
    assert names and all(prefix in name for name in names), names
    x = torch.randn(3, 4)
    model(x).sum().backward()
    plain(x).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
