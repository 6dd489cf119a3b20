"""The device audit: a device-less tensor factory in a rank's test body fails the test.

Two inner sessions (one per launcher) run one module of cases; the other tests here use the
mode in this process, without ranks.
"""

from __future__ import annotations

import textwrap
import threading

import pytest
import torch
import torch.nn as nn

from distconform.harness.rank.device_audit import DeviceAudit, DeviceAuditError

# Lines tagged "# LINE:<name>" are the ones a failure must name.
AUDITED_MODULE = textwrap.dedent(
    """
    import os

    import pytest
    import torch
    import torch.nn as nn

    from repo_helpers import make_buffer

    TORCH_DIR = os.path.dirname(torch.__file__)


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_randn_without_device(rank_ctx):
        torch.randn(4)  # LINE:randn


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_linear_without_device(rank_ctx):
        nn.Linear(4, 4)  # LINE:linear


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_repo_helper_without_device(rank_ctx):
        make_buffer(3)


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_set_default_device_does_not_count(rank_ctx):
        torch.set_default_device(rank_ctx.device)
        try:
            torch.zeros(3)  # LINE:default
        finally:
            torch.set_default_device(None)


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_library_forwarding_device_none_blames_the_caller(rank_ctx):
        code = compile("torch.zeros(3, device=None)", os.path.join(TORCH_DIR, "_fake.py"), "exec")
        exec(code, {"torch": torch})  # LINE:forwarded


    @pytest.mark.device_audit
    @pytest.mark.world_size(2)
    def test_explicit_devices_pass(rank_ctx):
        x = torch.randn(4, device=rank_ctx.device)
        model = nn.Linear(4, 4, device=rank_ctx.device)
        with torch.device(rank_ctx.device):
            inner = nn.Linear(4, 4)
            torch.as_tensor([1.0, 2.0])
            torch.arange(3)
        torch.zeros_like(x)
        torch.randn_like(x)
        x.new_zeros(3)
        x.new_tensor([1.0])
        torch.tensor(x)
        torch.normal(x, 1.0)
        torch.empty(4, out=torch.empty(0, device=rank_ctx.device))
        model(x).sum().backward()
        torch.optim.Adam(model.parameters()).step()
        # A library's own device-less tensor (no device keyword at all) is its choice.
        fake_torch_file = os.path.join(TORCH_DIR, "_fake.py")
        exec(compile("torch.zeros(3)", fake_torch_file, "exec"), {"torch": torch})


    @pytest.mark.device_audit(False)
    @pytest.mark.world_size(2)
    def test_opted_out(rank_ctx):
        torch.randn(4)


    @pytest.mark.world_size(2)
    def test_unmarked(rank_ctx):
        torch.ones(2)  # LINE:unmarked
    """
).strip()  # makepyfile strips the source too: keep the tagged line numbers equal

REPO_HELPERS = textwrap.dedent(
    """
    import torch


    def make_buffer(n):
        return torch.zeros(n)  # LINE:helper
    """
).strip()


def _line(source: str, name: str) -> int:
    for number, text in enumerate(source.splitlines(), start=1):
        if text.endswith(f"# LINE:{name}"):
            return number
    raise AssertionError(f"no line tagged {name}")


def _expected_failures(unmarked: bool) -> list[str]:
    def where(name: str, module: str = "test_audited.py", source: str = AUDITED_MODULE) -> str:
        return f"{module}:{_line(source, name)}"

    lines = [
        f"*{where('randn')} created a tensor with torch.randn and no device: on an accelerator "
        f"run it would land on the CPU, not on this rank's device (cpu). Pass "
        f'device=rank_ctx.device or build it inside "with torch.device(rank_ctx.device):"',
        f"*{where('linear')} created a tensor with torch.empty "
        f"(via torch.nn.modules.linear.Linear.__init__) and no device*",
        f"*{where('helper', 'repo_helpers.py', REPO_HELPERS)} created a tensor with "
        f"torch.zeros and no device*",
        f"*{where('default')} created a tensor with torch.zeros and no device*",
        f"*{where('forwarded')} created a tensor with torch.zeros (via *) and no device*",
    ]
    if unmarked:
        lines.append(f"*{where('unmarked')} created a tensor with torch.ones and no device*")
    return lines


def _write_cases(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_audited=AUDITED_MODULE, repo_helpers=REPO_HELPERS)


def test_process_ranks_fail_device_less_factories_under_the_marker(pytester):
    _write_cases(pytester)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--launcher", "process")
    result.assert_outcomes(failed=5, passed=3)
    for line in _expected_failures(unmarked=False):
        result.stdout.fnmatch_lines([line])
    result.stdout.no_fnmatch_line("*--dist-device-audit*")


@pytest.mark.slow  # an end-to-end session of tens of seconds; nightly (tox -e slow) keeps it
def test_the_option_audits_every_test_on_thread_ranks(pytester):
    _write_cases(pytester)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--launcher", "thread", "--dist-device-audit"
    )
    # Unmarked tests are audited too; device_audit(False) still opts out.
    result.assert_outcomes(failed=6, passed=2)
    for line in _expected_failures(unmarked=True):
        result.stdout.fnmatch_lines([line])
    result.stdout.fnmatch_lines(["*test_unmarked*--launcher thread*--dist-device-audit*"])


def test_the_ini_value_turns_the_audit_on(pytester):
    from distconform.harness.controller.session import SETTINGS_KEY

    pytester.makeini("[pytest]\ndist_device_audit = true\n")
    assert pytester.parseconfigure().stash[SETTINGS_KEY].device_audit is True


# --- the mode itself, in this process -------------------------------------------------------


def test_a_device_context_entered_inside_the_audit_fills_the_device_first():
    # `with torch.device(...)` pushes torch's DeviceContext above the audit on the mode
    # stack, so the audit receives the call with the device already filled in. If a torch
    # upgrade put it below instead, the first call in the block would fail here.
    with DeviceAudit("cpu"):
        with pytest.raises(DeviceAuditError, match=r"test_device_audit\.py:\d+ created"):
            torch.zeros(2)
        with torch.device("cpu"):
            assert torch.zeros(2).device.type == "cpu"
            nn.Linear(2, 2)
        with pytest.raises(DeviceAuditError):
            torch.zeros(2)  # the block's device is gone with the block


def test_the_audit_is_active_only_on_the_thread_that_entered_it():
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            torch.zeros(2)
        except BaseException as exc:
            errors.append(exc)

    with DeviceAudit("cpu"):
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        with pytest.raises(DeviceAuditError):
            torch.zeros(2)
    assert errors == []


def test_the_message_names_a_non_cpu_rank_device_and_a_set_default_device():
    with DeviceAudit("meta"), pytest.raises(DeviceAuditError) as excinfo:
        torch.zeros(2)
    assert "it lands on the CPU, not on this rank's device (meta)" in str(excinfo.value)
    torch.set_default_device("meta")
    try:
        with DeviceAudit("meta"), pytest.raises(DeviceAuditError) as excinfo:
            torch.zeros(2)
    finally:
        torch.set_default_device(None)
    assert "torch.set_default_device(meta) does not count" in str(excinfo.value)


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor:UserWarning")
def test_factories_given_a_tensor_or_a_device_pass():
    source = torch.ones(2)
    with DeviceAudit("cpu"):
        torch.tensor(source)
        torch.as_tensor(source)
        torch.normal(source, source)
        torch.full((2,), 1.0, device="cpu")
        torch.empty(2, out=torch.empty(0, device="cpu"))
        with pytest.raises(DeviceAuditError, match=r"torch\.normal and no device"):
            torch.normal(0.0, 1.0, (2,))
        with pytest.raises(DeviceAuditError, match=r"torch\.as_tensor and no device"):
            torch.as_tensor([1.0])
