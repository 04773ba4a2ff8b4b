"""H2O (Zhang et al. 2023, "Heavy-Hitter Oracle"): `heavy` hitters by accumulated attention + the
`recent` newest tokens.

A held token's score is the running sum, over every query that saw it, of the attention it
received, summed over the query heads of its GQA group (per KV head). With `normalize=True` the
sum is divided by the number of queries that saw the token, so old tokens do not win only by
having been seen longer.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy


@register_policy
@dataclass
class H2OPolicy(Policy):
    """Heavy hitters by accumulated attention + the newest tokens (H2O)."""

    name = "h2o"

    heavy: int | float = 128
    """Heavy hitters kept: a count, or a share of the prompt."""
    recent: int | float = 128
    """Newest tokens kept: a count, or a share of the prompt."""
    normalize: bool = False
    """Divide each score by the number of queries that saw the token."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.heavy == 0 and self.recent == 0:
            raise SparsegenError(f"{self.name} needs heavy + recent > 0")

    def score(self, step):
        return step.scores + step.received()

    def heavy_score(self, step):
        if not self.normalize:
            return step.scores
        return step.scores / (step.seen - step.positions).clamp_min(1).to(step.scores.dtype)

    def priority(self, step):
        return self.heavy_score(step).masked_fill(step.is_recent(), KEEP)
