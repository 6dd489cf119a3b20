"""The reference's errors say more than FSDP2 requires.

That a weight tied across two groups fails at the first forward, naming the parameter, is a
conformance case (``fsdp.shared_params.separate_groups_error`` in ``suites/test_shared_params.py``);
torch's message names only the parameter, the reference's also both groups' modules.
"""

from __future__ import annotations

import pytest
import torch

from distconform.impl import reference
from distconform.suites.models import TiedModel


@pytest.mark.world_size(2)
def test_tied_weight_across_groups_error_names_both_groups_modules(rank_ctx):
    with torch.device(rank_ctx.device):
        model = TiedModel()
    reference.fully_shard(model.tok_embeddings)
    reference.fully_shard(model.output)
    reference.fully_shard(model)
    with pytest.raises(ValueError, match="already managed by another") as info:
        model(torch.randint(0, 17, (2, 8), device=rank_ctx.device))
    message = str(info.value)
    assert "tok_embeddings" in message and "output (" in message, message
