"""H2O: `heavy` hitters by accumulated attention + the `recent` newest tokens.

The score of a held token is the running sum, over every query that saw it, of the attention
probability it received, summed over the query heads of its GQA group (per KV head). With
`normalize=True` the sum is divided by the number of queries that saw the token, which stops old
tokens from winning only by having been seen longer.
"""

from __future__ import annotations

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.base import KEEP, Policy, is_recent, register_policy


@register_policy
class H2OPolicy(Policy):
    name = "h2o"
    needs_scores = True

    def __init__(self, heavy: int | float = 128, recent: int | float = 128, normalize: bool = False) -> None:
        super().__init__(heavy=heavy, recent=recent)
        if heavy == 0 and recent == 0:
            raise SparsegenError("h2o needs heavy + recent > 0")
        self.normalize = normalize

    def heavy_score(self, positions: torch.Tensor, scores: torch.Tensor, length: int) -> torch.Tensor:
        if not self.normalize:
            return scores
        return scores / (length - positions).clamp_min(1).to(scores.dtype)

    def priority(self, positions, scores, length, sizes) -> torch.Tensor:
        return self.heavy_score(positions, scores, length).masked_fill(is_recent(positions, length, sizes), KEEP)

    def describe(self) -> str:
        return super().describe() + (" normalized" if self.normalize else "")
