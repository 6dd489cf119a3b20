"""distconform's harness: run a function or a pytest test on N ranks and report honestly.

Private: users and extensions import these names from :mod:`distconform.api` and
:mod:`distconform.extension`, the declared surface. Kept here for the harness's own code:

- ``@pytest.mark.world_size(2, 4)`` and the ``rank_ctx`` fixture (the pytest plugin);
- :func:`run_on_ranks` / :func:`launch` for code that is not a test, and
  :func:`run_in_session` for examples a test draws in the pytest process (Hypothesis), on the
  session's warm pools;
- :func:`get_rank_context` inside a function running on a rank;
- :class:`RankLocal` for fixtures whose value must be built inside each rank;
- :class:`DeviceAudit` (a ``TorchFunctionMode``) and :class:`DeviceAuditError`, the check
  behind ``@pytest.mark.device_audit`` and ``--dist-device-audit``.

Names are imported on first use, so tools that only need a light module (the fork
server's clients, device leasing) do not pay for importing torch.
"""

from __future__ import annotations

from distconform._lazy import lazy_exports

_EXPORTS = {
    "ConfigError": "distconform.harness.controller.config",
    "DeviceAudit": "distconform.harness.rank.device_audit",
    "DeviceAuditError": "distconform.harness.rank.device_audit",
    "DistributedFailure": "distconform.harness.controller.failure_report",
    "Outcome": "distconform.harness.shared.outcomes",
    "RankContext": "distconform.harness.shared.rank_context",
    "RankLocal": "distconform.harness.shared.rank_context",
    "RankResult": "distconform.harness.shared.outcomes",
    "RunResult": "distconform.harness.shared.outcomes",
    "get_rank_context": "distconform.harness.shared.rank_context",
    "launch": "distconform.harness.controller.run_function",
    "run_in_session": "distconform.harness.controller.session_ranks",
    "run_on_ranks": "distconform.harness.controller.run_function",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
