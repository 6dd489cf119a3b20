"""Who a rank is under torchrun or srun, and how a peer's failure reaches a blocked rank."""

from __future__ import annotations

import time

import pytest

from distconform.harness.controller.config import ConfigError
from distconform.harness.controller.external.rank import ExternalRank
from distconform.harness.controller.external.report_diversion import report_file
from distconform.harness.controller.external.world import _PeerFailureWatch

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "node0",
            "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job-7"}  # fmt: skip
SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_JOB_ID": "123456", "MASTER_ADDR": "node0"}  # fmt: skip
ALL = {*TORCHRUN, *SLURM, "MASTER_PORT"}


@pytest.fixture
def environment(monkeypatch):
    for name in ALL:
        monkeypatch.delenv(name, raising=False)

    def set_to(values: dict[str, str]) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)

    return set_to


def test_torchrun_variables(environment):
    environment(TORCHRUN)
    me = ExternalRank.from_environment()
    assert (me.rank, me.world_size, me.local_rank, me.starter) == (3, 4, 1, "torchrun")
    assert (me.master_addr, me.master_port, me.run_id) == ("node0", 29400, "job-7")
    assert not me.hosts_store  # torchrun's agent serves the store


def test_slurm_variables_with_a_port_every_task_derives_alike(environment):
    environment(SLURM)
    me = ExternalRank.from_environment()
    assert (me.rank, me.world_size, me.local_rank, me.starter) == (5, 8, 1, "slurm")
    assert me.master_port == 29500 + 123456 % 1000 and me.run_id == "slurm-123456"
    assert not me.hosts_store
    environment({"SLURM_PROCID": "0", "MASTER_PORT": "31000"})
    rank0 = ExternalRank.from_environment()
    assert rank0.hosts_store and rank0.master_port == 31000


def test_missing_variables_say_how_to_start_the_world(environment):
    environment({"RANK": "0"})
    with pytest.raises(ConfigError, match="WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set"):
        ExternalRank.from_environment()


def test_each_rank_reports_to_its_own_file_of_the_job(environment, monkeypatch, tmp_path):
    monkeypatch.setenv("DISTCONFORM_RANK_REPORT_DIR", str(tmp_path))
    environment(SLURM)
    assert report_file(ExternalRank.from_environment()) == tmp_path / "slurm-123456/rank5.txt"


class _Store:
    def __init__(self) -> None:
        self.keys: set[str] = set()

    def check(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)


def test_a_peer_failure_aborts_the_groups_of_a_rank_still_in_its_test():
    # The NCCL path, observed on CPU: the watcher aborts when a peer's failure appears.
    store, aborted = _Store(), []
    watch = _PeerFailureWatch(store, "7/failed", lambda: aborted.append(time.monotonic()))
    time.sleep(0.3)
    assert not aborted
    store.keys.add("7/failed")
    seen_at = time.monotonic()
    time.sleep(1.5)
    watch.cancel()
    assert watch.seen and len(aborted) == 1 and aborted[0] - seen_at < 1.5


def test_a_test_that_ends_in_time_is_never_aborted():
    store, aborted = _Store(), []
    watch = _PeerFailureWatch(store, "8/failed", lambda: aborted.append(True))
    store.keys.add("8/failed")
    time.sleep(0.3)  # seen, but the test returns within the grace
    watch.cancel()
    assert watch.seen and aborted == []
