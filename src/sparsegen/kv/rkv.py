"""R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Training-Free Reasoning
Models Acceleration"): while the model writes a long output, keep the tokens that are both
important and not redundant; of near-duplicate keys the newest stays.

Redundancy is the running score: each held token's largest cosine similarity to any key written
after it, `r_i = max(0, max_{j later} cos(k_i, k_j))` over the keys as attention saw them. A new
key only updates it: its cosine to every held key (n * d per KV head and step), the older ones
raising their running max; the new key starts at 0 (nothing later yet). Later keys count even
once evicted: a token once duplicated stays redundant. Importance is the attention the newest
`window` queries of the call pay each held key, summed over the KV head's query group (while
decoding: the new token's query alone). Both are min-max normalised per head over the tokens that
compete (held, neither sinks nor recent), `norm(x) = (x - min) / (max - min)` (0 where all are
equal), and the keep-priority is `importance * norm(I) - (1 - importance) * norm(R)` (the paper's
lambda, 0.1). The sinks and the `recent` newest tokens are always kept. Per decoding step:
O(n * d) for the cosines plus the attention the layer already computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy

_BLOCK = 1 << 22  # cosines computed at once while a prompt chunk arrives (elements)


def later_similarity(keys: torch.Tensor, positions: torch.Tensor, new: int) -> torch.Tensor:
    """Each held key's largest cosine to the `new` newest keys written after it, at least 0:
    keys [b, h, n, d], positions [b, h, n] (the newest hold the highest positions) -> [b, h, n]."""
    units = F.normalize(keys.float(), dim=-1)
    newest = positions.topk(new, dim=-1).indices  # [b, h, new]
    news = units.gather(2, newest.unsqueeze(-1).expand(-1, -1, -1, units.shape[-1]))
    at = positions.gather(2, newest)
    best = torch.zeros_like(positions, dtype=torch.float32)
    step = max(1, _BLOCK // max(1, units.shape[0] * units.shape[1] * units.shape[2]))
    for start in range(0, new, step):
        cosines = units @ news[:, :, start : start + step].transpose(-1, -2)  # [b, h, n, block]
        later = positions.unsqueeze(-1) < at[:, :, None, start : start + step]
        best = torch.maximum(best, cosines.masked_fill(~later, 0.0).amax(-1))
    return best


def normalised(values: torch.Tensor, competing: torch.Tensor) -> torch.Tensor:
    """Min-max over the `competing` tokens of each head, 0 where they are all equal (or none)."""
    low = values.masked_fill(~competing, float("inf")).amin(-1, keepdim=True)
    high = values.masked_fill(~competing, float("-inf")).amax(-1, keepdim=True)
    spread = high - low
    scaled = (values - low) / torch.where(spread > 0, spread, 1.0)
    return torch.where(spread > 0, scaled, 0.0)


@register_policy
@dataclass
class RKVPolicy(Policy):
    """Attention sinks + important, non-redundant tokens + the newest tokens (R-KV)."""

    name = "rkv"
    reads_keys = True

    sinks: int = 4
    """First tokens, never evicted."""
    heavy: int | float = 124
    """Tokens kept by importance and non-redundancy: a count, or a share of the prompt."""
    recent: int | float = 128
    """Newest tokens kept (the paper's buffer): a count, or a share of the prompt."""
    importance: float = 0.1
    """lambda: the weight of importance against redundancy (1 - lambda), in [0, 1]."""
    window: int = 8
    """The newest queries of a call whose attention is the importance (a prompt's; one while decoding)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.importance <= 1.0:
            raise SparsegenError(f"rkv importance must be in [0, 1], got {self.importance}")
        if self.window < 1:
            raise SparsegenError(f"rkv window must be >= 1, got {self.window}")

    def score(self, step):
        if step.keys is None:
            raise SparsegenError("rkv scores the held keys: they must be read as numbers while decoding")
        return torch.maximum(step.scores, later_similarity(step.keys, step.positions, step.new))

    def priority(self, step):
        kept = step.is_sink() | step.is_recent()
        competing = (step.positions >= 0) & ~kept
        important = normalised(step.received(last=self.window), competing)
        redundant = normalised(step.scores.float(), competing)
        priority = self.importance * important - (1 - self.importance) * redundant
        return priority.masked_fill(kept, KEEP)
