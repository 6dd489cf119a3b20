"""--dist-share-devices: ranks round-robin on fewer devices, and the backends that refuse.

No accelerator is needed: ``DISTCONFORM_FAKE_DEVICE_COUNT`` stands for the machine's device
count, and everything checked here is decided before any rank starts.
"""

from __future__ import annotations

import pytest

from distconform.harness.backends import staged_gloo
from distconform.harness.controller.config import DistSettings, binds_device_id, sharing_refusal
from distconform.harness.controller.dispatch import make_pool
from distconform.harness.controller.leasing import FAKE_COUNT_ENV, LeasedPool
from distconform.harness.controller.pools import PoolKey
from distconform.harness.controller.process.pool import ProcessPool

NEEDS_FOUR_RANKS = """
    import pytest

    @pytest.mark.world_size(4)
    def test_four(rank_ctx):
        pass
"""


def test_nccl_is_refused_in_one_line_naming_what_to_run_instead():
    refusal = sharing_refusal("nccl", "cuda", world_size=4, devices=1)
    assert refusal is not None and "\n" not in refusal
    for words in ("nccl", "ws 4 on 1 cuda device", "--backend staged_gloo --dist-share-devices"):
        assert words in refusal


@pytest.mark.parametrize(
    ("backend", "world_size", "devices"),
    [("staged_gloo", 4, 1), ("gloo", 8, 2), ("nccl", 2, 2), ("nccl", 1, 1)],
)
def test_backends_that_can_share_or_need_not_are_not_refused(backend, world_size, devices):
    assert sharing_refusal(backend, "cuda", world_size, devices) is None


def test_a_failure_names_the_shared_placement(monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "1")
    shared = DistSettings(backend="staged_gloo", device_type="cuda", share_devices=True)
    assert shared.placement(4) == "ws 4 on 1 device"
    assert shared.placement(1) == "ws 1"
    assert DistSettings(device_type="cuda").placement(4) == "ws 4"
    assert DistSettings(share_devices=True).placement(4) == "ws 4"  # CPU ranks share nothing


def test_only_c10d_backends_are_bound_to_their_device():
    assert binds_device_id("nccl") and binds_device_id("gloo")
    assert not binds_device_id(staged_gloo.BACKEND_NAME)  # registered from Python


def _key(share: bool, world_size: int = 4) -> PoolKey:
    return PoolKey(
        launcher="process",
        world_size=world_size,
        backend=staged_gloo.BACKEND_NAME,
        device_type="cuda",
        threads_per_rank=1,
        share_devices=share,
    )


def test_shared_ranks_go_round_robin_on_the_devices_and_lease_none(monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "2")
    pool = make_pool(_key(share=True))
    assert isinstance(pool, ProcessPool)  # no lease: sharing ranks take the devices there are
    specs = [pool._worker_spec(rank, {}, 0, pool_path) for rank, pool_path in enumerate("abcd")]
    assert [spec.device_index for spec in specs] == [0, 1, 0, 1]
    assert not any(spec.bind_device for spec in specs)


def test_without_sharing_each_rank_leases_a_device_of_its_own(monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "4")
    pool = make_pool(_key(share=False))
    assert isinstance(pool, LeasedPool) and pool.devices == 4


def test_nccl_tests_with_more_ranks_than_devices_skip_before_any_rank_starts(pytester, monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "1")
    pytester.makepyfile(test_four=NEEDS_FOUR_RANKS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "--device", "cuda", "--backend", "nccl",
        "--dist-share-devices",
    )  # fmt: skip
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        [
            "distconform: ranks share the 1 cuda device(s) round-robin*nccl cannot*",
            "*nccl cannot share devices*ws 4 on 1 cuda device*--backend staged_gloo*",
        ]
    )


def test_without_sharing_a_test_needs_a_device_per_rank(pytester, monkeypatch):
    monkeypatch.setenv(FAKE_COUNT_ENV, "1")
    pytester.makepyfile(test_four=NEEDS_FOUR_RANKS)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "--device", "cuda", "--backend", "nccl"
    )
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*needs 4 cuda device(s), this machine has 1*"])
