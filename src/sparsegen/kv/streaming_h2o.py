"""Streaming-H2O: attention sinks + heavy hitters + the newest tokens, with rolling positions."""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.h2o import H2OPolicy
from sparsegen.kv.policy import KEEP, register_policy


@register_policy
@dataclass
class StreamingH2OPolicy(H2OPolicy):
    """Attention sinks + heavy hitters + the newest tokens (Streaming-H2O)."""

    name = "streaming_h2o"
    default_position = "rolling"

    sinks: int = 4
    """First tokens, never evicted."""
    heavy: int | float = 124
    """Heavy hitters kept: a count, or a share of the prompt."""

    def priority(self, step):
        return self.heavy_score(step).masked_fill(step.is_sink() | step.is_recent(), KEEP)
