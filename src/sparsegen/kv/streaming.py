"""StreamingLLM: `sinks` first tokens (attention sinks) + the `recent` newest tokens.

Positions default to "rolling" (positions within the cache), which is what keeps a stream stable
past the model's pretrained window.
"""

from __future__ import annotations

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.base import KEEP, Policy, is_sink, register_policy


@register_policy
class StreamingPolicy(Policy):
    name = "streaming"
    default_position = "rolling"

    def __init__(self, sinks: int = 4, recent: int | float = 252) -> None:
        super().__init__(sinks=sinks, recent=recent)
        if recent == 0:
            raise SparsegenError("streaming needs recent > 0 (sinks alone cannot hold the new tokens)")

    def priority(self, positions, scores, length, sizes) -> torch.Tensor:
        return positions.float().masked_fill(is_sink(positions, sizes), KEEP)
