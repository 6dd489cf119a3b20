"""What a property example is, how Hypothesis draws one, and the Hypothesis profiles."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

PROFILE_ENV = "DISTCONFORM_HYPOTHESIS_PROFILE"
REPLAY_ENV = "DISTCONFORM_PROPERTY_EXAMPLE"
MAX_WORLD_SIZE = 8

_COMMON = {
    "deadline": None,  # a rank start or a loaded CI machine is not a bug
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    "print_blob": False,
}
settings.register_profile("distconform-ci", max_examples=3, derandomize=True, **_COMMON)
settings.register_profile("distconform-slow", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("distconform-explore", max_examples=200, derandomize=False, **_COMMON)


def profile(default: str = "distconform-ci") -> settings:
    return settings.get_profile(os.environ.get(PROFILE_ENV) or default)


@dataclass(frozen=True)
class TrainingExample:
    """One sharded training run to compare with a plain model.

    ``dims`` are the feature sizes through the layer stack (``len(dims) - 1`` linears);
    ``own_group[i]`` says whether linear ``i`` gets a ``fully_shard`` of its own before the
    root's; ``mesh_shape`` is ``(world_size,)`` or ``(replicate, shard)``.
    """

    world_size: int
    mesh_shape: tuple[int, ...]
    dims: tuple[int, ...]
    own_group: tuple[bool, ...]
    reshard_after_forward: bool | int
    microbatches: int
    batch: int
    steps: int = 2

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> TrainingExample:
        data = json.loads(text)
        for name in ("mesh_shape", "dims", "own_group"):
            data[name] = tuple(data[name])
        return cls(**data)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def training_examples(
    draw: st.DrawFn, capabilities: frozenset[str], max_world_size: int = MAX_WORLD_SIZE
) -> TrainingExample:
    """Examples that only use what ``capabilities`` declares (the rest is UNSUPPORTED)."""
    world_size = draw(st.integers(1, max_world_size), label="world_size")
    mesh_shape: tuple[int, ...] = (world_size,)
    two_d = [(r, world_size // r) for r in _divisors(world_size) if 1 < r < world_size]
    if "hsdp" in capabilities and two_d and draw(st.booleans(), label="hsdp"):
        mesh_shape = draw(st.sampled_from(two_d), label="mesh_shape")
    # Sizes around and below the world size: uneven shards and ranks with empty shards.
    dims = tuple(draw(st.lists(st.integers(1, 17), min_size=2, max_size=5), label="dims"))
    own_group = tuple(draw(st.lists(st.booleans(), min_size=len(dims) - 1, max_size=len(dims) - 1)))
    raf_choices: list[bool | int] = [True, False]
    shard_size = mesh_shape[-1]
    if "reshard_after_forward_int" in capabilities and len(mesh_shape) == 1:
        raf_choices += [d for d in _divisors(shard_size) if 1 < d < shard_size]
    raf = draw(st.sampled_from(raf_choices), label="reshard_after_forward")
    max_microbatches = 3 if "gradient_accumulation" in capabilities else 1
    microbatches = draw(st.integers(1, max_microbatches), label="microbatches")
    batch = draw(st.integers(1, 4), label="batch")
    return TrainingExample(world_size, mesh_shape, dims, own_group, raf, microbatches, batch)
