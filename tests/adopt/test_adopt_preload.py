"""``--dist-adopt`` with a CPU build of torch: the fork server loads the modules of torch's test
package that a collected file imports, so that every rank it forks starts with them (4 to 5 s
of import on 2 cores each time a pool's ranks would otherwise load them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Records, before its own imports, whether the process importing it had torch's test package
#: loaded already: never pytest's process (nothing there imports it first), and a rank only
#: if its fork server did.
SAMPLE = """
import sys

LOADED_BEFORE_THIS_MODULE = "torch.testing._internal.common_distributed" in sys.modules

import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class TestRanksStartWithTheTestPackage(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def test_the_fork_server_loaded_it_on_a_cpu_build(self):
        # A torch built for an accelerator: the ranks import it after the fork (it may
        # initialise the accelerator, which a fork must not inherit).
        cpu_build = not any(getattr(torch.version, b, None) for b in ("cuda", "hip", "xpu"))
        assert LOADED_BEFORE_THIS_MODULE == cpu_build, f"rank {dist.get_rank()}, {cpu_build=}"
"""


def test_ranks_start_with_the_test_package_the_file_imports(tmp_path):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--dist-adopt", "-p", "no:cacheprovider", "-q",
         "test_sample.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout
