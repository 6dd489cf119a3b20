"""distconform's user API: what a test, a fixture or a script imports.

Markers, registered by the pytest plugin (use them as ``pytest.mark.NAME``; ``pytest
--markers`` prints each with its arguments):

- ``world_size(*sizes, slow=())``: run the test body on every rank, once per world size;
- ``deadline(seconds)``, ``fresh_pool``, ``memory_limit(size)``;
- ``requires_devices(n)``, ``requires_accelerator``;
- ``device_audit(enabled=True)``, ``stream_check(enabled=True)``.

The rank context: the ``rank_ctx`` fixture is a :class:`RankContext`; inside a function
running on a rank, :func:`get_rank_context` returns it; :class:`RankLocal` builds a fixture's
value inside each rank.

Running a function on ranks: :func:`run_on_ranks` (raises :class:`DistributedFailure`),
:func:`launch` (returns the :class:`RunResult`), :func:`run_in_session` (on the pytest
session's warm pools, for examples drawn inside a test).

Parity tools (:func:`assert_sharded_parity`, :class:`ReferenceModel`,
:func:`average_gradients`, :func:`assert_losses_equal`, :func:`tolerance`...) and comm tools
(:class:`CommTracer`, :func:`assert_schedule`, :func:`delay_collectives`,
:func:`wrap_collectives`, :func:`find_divergence`, :func:`min_bytes_per_rank`...).

Every name is imported on first use: ``import distconform.api`` imports neither torch nor
the pytest plugin. Anything not named here is private and may change without notice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from distconform._lazy import MODULE_PREFIX, lazy_exports

if TYPE_CHECKING:
    from distconform.harness import (
        torch_api,
    )
    from distconform.harness.comm import (
        CollectiveCall,
        CommTotals,
        CommTracer,
        Divergence,
        MinBytes,
        RawCall,
        assert_schedule,
        busy_wait,
        delay_collectives,
        device_sleep,
        find_divergence,
        format_schedule,
        mesh_group_labels,
        min_bytes_per_rank,
        padded_numel,
        wrap_collectives,
    )
    from distconform.harness.comm.intercept import (
        Interceptor,
        Proceed,
    )
    from distconform.harness.comm.records import (
        dtype_name,
    )
    from distconform.harness.controller.config import (
        ConfigError,
    )
    from distconform.harness.controller.failure_report import (
        DistributedFailure,
    )
    from distconform.harness.controller.run_function import (
        launch,
        run_on_ranks,
    )
    from distconform.harness.controller.session_ranks import (
        run_in_session,
    )
    from distconform.harness.devices import (
        current_stream_set,
        event_wait_record,
    )
    from distconform.harness.parity import (
        LossHistory,
        Mismatch,
        ParityError,
        ReferenceModel,
        assert_losses_equal,
        assert_sharded_parity,
        assert_tensors_close,
        average_gradients,
        compare_tensors,
        tolerance,
    )
    from distconform.harness.rank.device_audit import (
        DeviceAudit,
        DeviceAuditError,
    )
    from distconform.harness.shared.outcomes import (
        Outcome,
        RankResult,
        RunResult,
    )
    from distconform.harness.shared.rank_context import (
        RankContext,
        RankLocal,
        get_rank_context,
    )

_COMM = "distconform.harness.comm"
_PARITY = "distconform.harness.parity"

_HOMES = {
    # the rank context
    "RankContext": "distconform.harness.shared.rank_context",
    "RankLocal": "distconform.harness.shared.rank_context",
    "get_rank_context": "distconform.harness.shared.rank_context",
    # running on ranks, and what comes back
    "run_on_ranks": "distconform.harness.controller.run_function",
    "launch": "distconform.harness.controller.run_function",
    "run_in_session": "distconform.harness.controller.session_ranks",
    "RunResult": "distconform.harness.shared.outcomes",
    "RankResult": "distconform.harness.shared.outcomes",
    "Outcome": "distconform.harness.shared.outcomes",
    "DistributedFailure": "distconform.harness.controller.failure_report",
    "ConfigError": "distconform.harness.controller.config",
    # device checks
    "DeviceAudit": "distconform.harness.rank.device_audit",
    "DeviceAuditError": "distconform.harness.rank.device_audit",
    "current_stream_set": "distconform.harness.devices",
    "event_wait_record": "distconform.harness.devices",
    # parity tools
    "tolerance": _PARITY,
    "compare_tensors": _PARITY,
    "assert_tensors_close": _PARITY,
    "average_gradients": _PARITY,
    "ReferenceModel": _PARITY,
    "assert_losses_equal": _PARITY,
    "LossHistory": _PARITY,
    "assert_sharded_parity": _PARITY,
    "ParityError": _PARITY,
    "Mismatch": _PARITY,
    # comm tools
    "CollectiveCall": _COMM,
    "CommTotals": _COMM,
    "CommTracer": _COMM,
    "Divergence": _COMM,
    "MinBytes": _COMM,
    "RawCall": _COMM,
    "assert_schedule": _COMM,
    "busy_wait": _COMM,
    "delay_collectives": _COMM,
    "device_sleep": _COMM,
    "find_divergence": _COMM,
    "format_schedule": _COMM,
    "mesh_group_labels": _COMM,
    "min_bytes_per_rank": _COMM,
    "padded_numel": _COMM,
    "wrap_collectives": _COMM,
    "dtype_name": "distconform.harness.comm.records",
    "Interceptor": "distconform.harness.comm.intercept",
    "Proceed": "distconform.harness.comm.intercept",
    # torch's public collectives under their 2.13 names, on any torch of the window
    "torch_api": MODULE_PREFIX + "distconform.harness.torch_api",
}

__all__ = [
    "CollectiveCall",
    "CommTotals",
    "CommTracer",
    "ConfigError",
    "DeviceAudit",
    "DeviceAuditError",
    "DistributedFailure",
    "Divergence",
    "Interceptor",
    "LossHistory",
    "MinBytes",
    "Mismatch",
    "Outcome",
    "ParityError",
    "Proceed",
    "RankContext",
    "RankLocal",
    "RankResult",
    "RawCall",
    "ReferenceModel",
    "RunResult",
    "assert_losses_equal",
    "assert_schedule",
    "assert_sharded_parity",
    "assert_tensors_close",
    "average_gradients",
    "busy_wait",
    "compare_tensors",
    "current_stream_set",
    "delay_collectives",
    "device_sleep",
    "dtype_name",
    "event_wait_record",
    "find_divergence",
    "format_schedule",
    "get_rank_context",
    "launch",
    "mesh_group_labels",
    "min_bytes_per_rank",
    "padded_numel",
    "run_in_session",
    "run_on_ranks",
    "tolerance",
    "torch_api",
    "wrap_collectives",
]
__getattr__, __dir__ = lazy_exports(__name__, _HOMES, globals())
