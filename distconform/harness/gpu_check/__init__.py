"""``python -m distconform gpu-check``: a timeboxed check of distconform on one accelerator.

Read in order: :mod:`~distconform.harness.gpu_check.environment` (what the machine is),
:mod:`~distconform.harness.gpu_check.steps` (what each step runs and how it is judged),
:mod:`~distconform.harness.gpu_check.runner` (child processes with limits, waves, the budget),
:mod:`~distconform.harness.gpu_check.report` (JSON and Markdown),
:mod:`~distconform.harness.gpu_check.cli`.
"""
