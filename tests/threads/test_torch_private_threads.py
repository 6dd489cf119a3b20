"""The thread-world accessors of harness/_torch_private.py refuse unaudited torch versions."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness import _torch_private
from harness._torch_private import PrivateTorchAccessError
from harness.threads import ThreadRunner

ACCESSORS = [
    _torch_private.install_thread_local_c10d_world,
    _torch_private.uninstall_thread_local_c10d_world,
    _torch_private.thread_local_c10d_world_installed,
    _torch_private.bind_thread_to_fresh_c10d_world,
    _torch_private.unbind_thread_c10d_world,
]


@pytest.mark.parametrize("accessor", ACCESSORS, ids=lambda f: f.__name__)
def test_accessor_refuses_other_torch_version(monkeypatch, accessor):
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    with pytest.raises(PrivateTorchAccessError, match=f"{accessor.__name__}.*2.14.0"):
        accessor()


def test_runner_refuses_other_torch_version(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "3.0.0+cpu")
    with pytest.raises(PrivateTorchAccessError):
        ThreadRunner(2)
    monkeypatch.undo()
    assert not _torch_private.thread_local_c10d_world_installed()


def test_changed_c10d_world_shape_is_refused(monkeypatch):
    # torch adding a field to c10d's world would make the per-thread copy share it.
    audited = _torch_private._AUDITED_C10D_WORLD_PROPERTIES - {"comms"}
    monkeypatch.setattr(_torch_private, "_AUDITED_C10D_WORLD_PROPERTIES", audited)
    with pytest.raises(PrivateTorchAccessError, match="re-audit"):
        _torch_private.install_thread_local_c10d_world()
    monkeypatch.undo()
    assert not _torch_private.thread_local_c10d_world_installed()
    assert not dist.is_initialized()


def test_install_is_reference_counted_and_uninstall_is_checked():
    _torch_private.install_thread_local_c10d_world()
    _torch_private.install_thread_local_c10d_world()
    _torch_private.uninstall_thread_local_c10d_world()
    assert _torch_private.thread_local_c10d_world_installed()
    _torch_private.uninstall_thread_local_c10d_world()
    assert not _torch_private.thread_local_c10d_world_installed()
    with pytest.raises(RuntimeError, match="without a matching install"):
        _torch_private.uninstall_thread_local_c10d_world()
