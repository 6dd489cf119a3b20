"""A test's tolerance override, as the expectations file gives it (picklable, for ranks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tolerance:
    """``rtol``/``atol`` to use instead of a test's own; ``None`` keeps the test's value."""

    rtol: float | None = None
    atol: float | None = None
    reason: str = ""
    source: str = ""

    def __bool__(self) -> bool:
        return self.rtol is not None or self.atol is not None

    def resolve(
        self, rtol: float | None = None, atol: float | None = None
    ) -> dict[str, float | None]:
        """Keyword arguments for ``distconform.harness.parity``: the override where set, else
        the given.

        ``None`` in the result means the dtype's default tolerance, as in
        ``distconform.harness.parity``.
        """
        return {
            "rtol": rtol if self.rtol is None else self.rtol,
            "atol": atol if self.atol is None else self.atol,
        }
