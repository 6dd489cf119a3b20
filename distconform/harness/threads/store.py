"""An in-process c10d store whose blocking reads give up the baton while they wait.

A ``HashStore`` would work for rendezvous-free init, but a blocking ``get``/``wait`` on it
(the store-based barrier c10d runs when ``TORCH_DIST_INIT_BARRIER=1``, or user code that
uses the store) would keep the baton while waiting for a key only another rank can set:
a deadlock. This store waits through :meth:`ThreadWorld.wait_until` instead, so a missing
key behaves like a pending collective (and takes part in deadlock detection).
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from distconform.harness.threads.world import ThreadWorld, current_rank


def _as_bytes(value: str | bytes | bytearray | list[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class RunStore(dist.Store):
    """Key/value store shared by the rank threads of one run."""

    def __init__(self, world: ThreadWorld, timeout: timedelta = timedelta(seconds=300)) -> None:
        super().__init__()
        self._world = world
        self._data = world.store_data
        self.set_timeout(timeout)

    def _block(self, keys: list[str], what: str, timeout: timedelta | None) -> None:
        if all(k in self._data for k in keys):
            return
        seconds = (timeout or self.timeout).total_seconds()
        here = current_rank()
        if here is None or here[0] is not self._world:
            raise RuntimeError(f"{what}: key missing and caller is not a rank thread of this run")
        try:
            self._world.wait_until(
                here[1], lambda: all(k in self._data for k in keys), what, seconds or None
            )
        except TimeoutError as error:
            # c10d's callers (the store-based barrier) expect the store's own error type.
            raise dist.DistStoreError(str(error)) from None

    def set(self, key: str, value: str | bytes) -> None:
        with self._world.lock:
            self._data[key] = _as_bytes(value)

    def get(self, key: str) -> bytes:
        self._block([key], f"store.get({key!r})", None)
        return self._data[key]

    def add(self, key: str, amount: int) -> int:
        with self._world.lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        with self._world.lock:
            current = self._data.get(key)
            expected_b = _as_bytes(expected)
            if (current is None and expected_b == b"") or current == expected_b:
                self._data[key] = _as_bytes(desired)
                return self._data[key]
            return current if current is not None else expected_b

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._block(list(keys), f"store.wait({list(keys)!r})", timeout)

    def check(self, keys: list[str]) -> bool:
        return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._world.lock:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        return len(self._data)
