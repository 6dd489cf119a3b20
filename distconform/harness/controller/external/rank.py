"""Who this process is in a world started by torchrun or Slurm's srun, from its environment.

No torch here: the harness reads it before pytest configures its terminal (a non-zero
rank's report goes to a file, :mod:`distconform.harness.controller.external.report_diversion`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from distconform.harness.controller.config import ConfigError

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_ENV = ("SLURM_PROCID", "SLURM_NTASKS", "MASTER_ADDR")
# srun sets no port: every task must agree on one, so it comes from the job's id.
_SLURM_BASE_PORT = 29500


@dataclass(frozen=True)
class ExternalRank:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    #: Who started the world: "torchrun" (its agent hosts the store) or "slurm" (rank 0
    #: hosts it).
    starter: str = "torchrun"
    #: An id shared by every rank of this job (names the non-zero ranks' report files).
    run_id: str = ""

    @classmethod
    def from_environment(cls) -> ExternalRank:
        env = os.environ
        if "RANK" not in env and all(name in env for name in _SLURM_ENV):
            job = env.get("SLURM_JOB_ID", "0")
            port = int(env.get("MASTER_PORT", _SLURM_BASE_PORT + int(job) % 1000))
            return cls(
                rank=int(env["SLURM_PROCID"]),
                world_size=int(env["SLURM_NTASKS"]),
                local_rank=int(env.get("SLURM_LOCALID", env["SLURM_PROCID"])),
                master_addr=env["MASTER_ADDR"],
                master_port=port,
                starter="slurm",
                run_id=f"slurm-{job}",
            )
        missing = [name for name in _TORCHRUN_ENV if name not in env]
        if missing:
            raise ConfigError(
                f"--launcher external joins a world started by torchrun or srun, but "
                f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; run "
                f"`torchrun --nproc-per-node N -m pytest ... --launcher external`, or under "
                f"Slurm `srun` with MASTER_ADDR exported (SLURM_PROCID and SLURM_NTASKS "
                f"come from srun)"
            )
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            run_id=env.get("TORCHELASTIC_RUN_ID") or f"{env['MASTER_ADDR']}-{env['MASTER_PORT']}",
        )

    @property
    def hosts_store(self) -> bool:
        """Whether this process serves the rendezvous store (torchrun's agent does it)."""
        return self.starter == "slurm" and self.rank == 0
