"""The thread-world accessors of harness/_torch_private.py: refused outside the window, the
per-thread c10d world built from the installed release's audited ``_World`` shape (torch 2.15
adds a property), and refused when the installed ``_World`` does not have that shape; and the
threaded backend answering the group-method names each release calls."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

from distconform.harness import _torch_private
from distconform.harness.threads import ThreadRunner
from distconform.harness.torch_window import (
    SUPPORTED_TORCH,
    V2_14,
    V2_15,
    PrivateTorchAccessError,
    installed_torch_version,
)

ACCESSORS = [
    _torch_private.install_thread_local_c10d_world,
    _torch_private.uninstall_thread_local_c10d_world,
    _torch_private.thread_local_c10d_world_installed,
    _torch_private.bind_thread_to_fresh_c10d_world,
    _torch_private.unbind_thread_c10d_world,
]


@pytest.mark.parametrize("accessor", ACCESSORS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("version", ["2.10.0", "2.16.0"])
def test_accessor_refuses_a_torch_outside_the_window(monkeypatch, accessor, version):
    monkeypatch.setattr(torch, "__version__", version)
    with pytest.raises(PrivateTorchAccessError, match=f"{accessor.__name__}.*{version}") as raised:
        accessor()
    assert "torch 2.11 to 2.15" in str(raised.value)


def test_runner_refuses_a_torch_outside_the_window(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "3.0.0+cpu")
    with pytest.raises(PrivateTorchAccessError, match=r"torch 2\.11 to 2\.15"):
        ThreadRunner(2)
    monkeypatch.undo()
    assert not _torch_private.thread_local_c10d_world_installed()


def test_the_world_shape_is_audited_per_release():
    shapes = _torch_private._AUDITED_C10D_WORLD_PROPERTIES
    assert set(shapes) == set(SUPPORTED_TORCH)
    assert shapes[V2_15] == shapes[V2_14] | {"pg_flight_recorder_hooks"}
    assert all(len(shapes[version]) == 11 for version in SUPPORTED_TORCH if version < V2_15)
    for version in SUPPORTED_TORCH:
        fields = _torch_private._per_thread_world_fields(version)
        assert "pg_config_info" not in fields  # computed by _World from the others
        state = _torch_private._RankC10dState(fields)
        assert sorted(vars(state)) == sorted(fields)  # a fresh value for every stored field


def test_the_installed_world_has_the_audited_shape():
    from torch.distributed import distributed_c10d

    found = {k for k, v in vars(distributed_c10d._World).items() if isinstance(v, property)}
    assert found == _torch_private._AUDITED_C10D_WORLD_PROPERTIES[installed_torch_version()]


def test_changed_c10d_world_shape_is_refused(monkeypatch):
    # torch adding a field to c10d's world would make the per-thread copy share it.
    version = installed_torch_version()
    audited = _torch_private._AUDITED_C10D_WORLD_PROPERTIES[version] - {"comms"}
    monkeypatch.setitem(_torch_private._AUDITED_C10D_WORLD_PROPERTIES, version, audited)
    with pytest.raises(PrivateTorchAccessError, match="re-audit"):
        _torch_private.install_thread_local_c10d_world()
    monkeypatch.undo()
    assert not _torch_private.thread_local_c10d_world_installed()
    assert not dist.is_initialized()


def _world_class_of_torch_2_15() -> type:
    """The installed ``_World`` plus torch 2.15's ``pg_flight_recorder_hooks``
    (``distributed_c10d.py`` 2.15: set in ``__init__`` at 1388, the property at 1480)."""
    from torch.distributed import distributed_c10d

    installed = distributed_c10d._World

    def init(self) -> None:
        installed.__init__(self)
        self._pg_flight_recorder_hooks = {}

    namespace = {k: v for k, v in vars(installed).items() if k not in ("__dict__", "__weakref__")}
    namespace["__init__"] = init
    namespace["pg_flight_recorder_hooks"] = property(lambda self: self._pg_flight_recorder_hooks)
    return type("_World", (), namespace)


def test_on_torch_2_15_a_world_without_its_new_property_is_refused(monkeypatch):
    if installed_torch_version() >= V2_15:
        pytest.skip("the installed torch is 2.15 or newer")
    monkeypatch.setattr(torch, "__version__", "2.15.0")
    with pytest.raises(PrivateTorchAccessError, match=r"pg_flight_recorder_hooks.*re-audit"):
        _torch_private.install_thread_local_c10d_world()
    monkeypatch.undo()
    assert not _torch_private.thread_local_c10d_world_installed()


def test_on_torch_2_15_each_rank_thread_has_its_own_flight_recorder_hooks(monkeypatch):
    """torch 2.15 pops a group's hook from ``_world.pg_flight_recorder_hooks`` on every destroy
    (``distributed_c10d.py`` 3333): a rank thread must find its own dict there, and threads
    that are not bound still see the process-wide one."""
    from torch.distributed import distributed_c10d

    if installed_torch_version() < V2_15:
        world_class = _world_class_of_torch_2_15()
        monkeypatch.setattr(torch, "__version__", "2.15.0")
        monkeypatch.setattr(distributed_c10d, "_World", world_class)
        monkeypatch.setattr(distributed_c10d, "_world", world_class())
    process_wide = distributed_c10d._world.pg_flight_recorder_hooks
    seen: dict[int, dict] = {}
    errors: list[BaseException] = []

    def rank_thread(rank: int) -> None:
        try:
            _torch_private.bind_thread_to_fresh_c10d_world()
            try:
                hooks = distributed_c10d._world.pg_flight_recorder_hooks
                hooks[rank] = f"hook of rank {rank}"
                distributed_c10d._world.pg_flight_recorder_hooks.pop("no such group", None)
                seen[rank] = dict(hooks)
            finally:
                _torch_private.unbind_thread_c10d_world()
        except BaseException as error:  # reported below, on the test's thread
            errors.append(error)

    _torch_private.install_thread_local_c10d_world()
    try:
        assert distributed_c10d._world.pg_flight_recorder_hooks is process_wide
        threads = [threading.Thread(target=rank_thread, args=(rank,)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        _torch_private.uninstall_thread_local_c10d_world()
    assert not errors, errors
    assert seen == {0: {0: "hook of rank 0"}, 1: {1: "hook of rank 1"}}
    assert "hook of rank 0" not in process_wide.values()


def test_install_is_reference_counted_and_uninstall_is_checked():
    _torch_private.install_thread_local_c10d_world()
    _torch_private.install_thread_local_c10d_world()
    _torch_private.uninstall_thread_local_c10d_world()
    assert _torch_private.thread_local_c10d_world_installed()
    _torch_private.uninstall_thread_local_c10d_world()
    assert not _torch_private.thread_local_c10d_world_installed()
    with pytest.raises(RuntimeError, match="without a matching install"):
        _torch_private.uninstall_thread_local_c10d_world()


#: What torch calls on a Python ProcessGroup for these collectives: 2.11 and 2.12 use the left
#: names (from distributed_c10d, and from C++ for functional collectives), 2.13 on the right ones.
RENAMED_GROUP_METHODS = {
    "_allgather_base": "all_gather_single",
    "allgather_into_tensor_coalesced": "all_gather_single_coalesced",
    "_reduce_scatter_base": "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_single_coalesced",
    "alltoall_base": "all_to_all_single",
}


@pytest.mark.parametrize(("older", "newer"), RENAMED_GROUP_METHODS.items())
def test_the_threaded_backend_answers_the_names_of_every_release(older, newer):
    from distconform.harness.threads.backend import ThreadedProcessGroup

    assert getattr(ThreadedProcessGroup, older) is getattr(ThreadedProcessGroup, newer)
