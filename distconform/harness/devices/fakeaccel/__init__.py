"""fakeaccel: a fake accelerator (a PrivateUse1 device) that every accelerator path runs on.

Importing this module makes ``--device fakeaccel`` work in this process, as a vendor's
device plug-in would: it builds the C++ device once per torch and Python (``fakeaccel.cpp``,
with ``torch.utils.cpp_extension``, into a cache directory; about 15 s on 2 cores), loads
it, names PrivateUse1 ``fakeaccel``, registers ``torch.fakeaccel`` (:mod:`.module`),
declares ``FAKEACCEL_VISIBLE_DEVICES`` as the variable device leases set, and registers the
``staged_gloo`` backend for the device, which makes it the device's default backend.

The harness imports it by itself for ``--device fakeaccel`` (in the pytest process and in
every rank, before the process group starts). ``FAKEACCEL_DEVICE_COUNT`` (default 8) is
the machine's device count. The cache directory is ``$DISTCONFORM_CACHE_DIR`` or
``~/.cache/distconform`` (``$XDG_CACHE_HOME``).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from pathlib import Path

import torch
from filelock import FileLock

from distconform.extension import DeviceType, register_device
from distconform.harness import _torch_private
from distconform.harness.backends import staged_gloo
from distconform.harness.devices.fakeaccel import module

DEVICE_TYPE = module.DEVICE_TYPE
VISIBILITY_VARIABLE = "FAKEACCEL_VISIBLE_DEVICES"
COUNT_VARIABLE = "FAKEACCEL_DEVICE_COUNT"
DEVICE = DeviceType(
    DEVICE_TYPE,
    visibility_variable=VISIBILITY_VARIABLE,
    plugin=__name__,
    case_skips={
        # Evidence: suites/composition/test_tensor_parallel.py
        # ::test_math_attention_on_tp_activations_cannot_be_sharded_on_the_fake_device.
        "fsdp.tp.shard_placement_fn_tp_ep": {
            "tp=2": "FAKEACCEL: attention on TP activations takes SDPA's math path off CUDA, "
            'which DTensor cannot shard ("got mixed torch.Tensor and DTensor")'
        }
    },
)
CACHE_VARIABLE = "DISTCONFORM_CACHE_DIR"
LIBRARY_NAME = "distconform_fakeaccel"
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("fakeaccel.cpp", "stream_checker.cpp", "stream_checker.h")
)


def cache_root() -> Path:
    named = os.environ.get(CACHE_VARIABLE)
    if named:
        return Path(named)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "distconform"


def build_directory() -> Path:
    """One directory per source, torch and Python: a change of any of them rebuilds."""
    key = hashlib.sha256()
    for source in SOURCES:
        key.update(source.read_bytes())
    key.update(torch.__version__.encode())
    key.update(f"{sys.version_info[:2]}-{platform.machine()}".encode())
    return cache_root() / "fakeaccel" / key.hexdigest()[:16]


def library_path() -> Path:
    return build_directory() / f"{LIBRARY_NAME}.so"


def build() -> Path:
    """The built library, compiled now if no earlier build left it (one build at a time)."""
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    library = library_path()
    with FileLock(str(directory / "build.lock")):
        if not library.exists():
            from torch.utils import cpp_extension  # only to build: it imports setuptools

            print(
                f"distconform: building the fakeaccel device (once per torch) in {directory}",
                file=sys.stderr,
                flush=True,
            )
            cpp_extension.load(
                name=LIBRARY_NAME,
                sources=[str(source) for source in SOURCES if source.suffix == ".cpp"],
                extra_cflags=["-O2"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
    return library


_loaded = False


def load() -> None:
    """Load and register the device in this process (once)."""
    global _loaded
    if _loaded:
        return
    torch.ops.load_library(str(build()))
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
    _torch_private.register_device_module(DEVICE_TYPE, module)
    torch.utils.generate_methods_for_privateuse1_backend()
    register_device(DEVICE)
    staged_gloo.register()  # again, now that the process has this accelerator
    _loaded = True


load()
