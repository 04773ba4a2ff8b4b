"""StreamingLLM (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks"):
the `sinks` first tokens + the `recent` newest tokens.

Positions default to "rolling" (positions within the cache), which is what keeps a stream stable
past the model's pretrained window.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy


@register_policy
@dataclass
class StreamingPolicy(Policy):
    """Attention sinks + the newest tokens (StreamingLLM)."""

    name = "streaming"
    default_position = "rolling"
    contiguous = True

    sinks: int = 4
    """First tokens, never evicted."""
    recent: int | float = 252
    """Newest tokens kept: a count, or a share of the prompt."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent == 0:
            raise SparsegenError("streaming needs recent > 0 (sinks alone cannot hold the new tokens)")

    def priority(self, step):
        return step.positions.float().masked_fill(step.is_sink(), KEEP)
