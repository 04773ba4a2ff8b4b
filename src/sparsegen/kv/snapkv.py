"""SnapKV (Li et al. 2024, "SnapKV: LLM Knows What You are Looking for Before Generation"): once
the prompt is read, keep the prompt tokens that its last `recent` tokens (the observation window)
attend to most, plus the window itself; decoding then keeps every new token.

Scores: the window queries' attention summed over the window and each GQA group, smoothed along
the prompt before the window by average pooling (`kernel` tokens wide, zeros past its ends, as the
paper's code) so that neighbours of an important token stay with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import KEEP, Policy, register_policy


@register_policy
@dataclass
class SnapKVPolicy(Policy):
    """Compress the prompt once by its observation window's attention (SnapKV)."""

    name = "snapkv"
    prefill_only = True

    heavy: int | float = 224
    """Prompt tokens kept by score: a count, or a share of the prompt."""
    recent: int = 32
    """The observation window: the prompt's last tokens, which score the rest and are all kept."""
    kernel: int = 5
    """Width of the average pooling over neighbouring scores (odd)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recent < 1 or self.kernel < 1 or self.kernel % 2 == 0:
            raise SparsegenError("snapkv needs recent >= 1 and an odd kernel >= 1")

    @classmethod
    def split(cls, rest: int | float) -> dict[str, int]:
        """The observation window (at most 32 tokens, at most half) and the prompt tokens kept by score."""
        if isinstance(rest, float):
            raise SparsegenError(
                f"{cls.name}'s observation window is a token count: give an int budget, or heavy= as a share "
                "with recent= as a count"
            )
        window = min(32, rest // 2)
        return {"heavy": rest - window, "recent": window}

    def score(self, step):
        received = step.received(last=self.recent)  # slots are in position order at the first call
        b, h, n = received.shape
        body = n - min(self.recent, n)  # the window is kept whole: only what precedes it is pooled
        if body == 0:
            return received
        pooled = F.avg_pool1d(received[..., :body].reshape(b * h, 1, body), self.kernel, 1, self.kernel // 2)
        return torch.cat([pooled.view(b, h, body), received[..., body:]], dim=-1)

    def priority(self, step):
        # Equal scores keep the newer token: a prompt shorter than the pooling window pools every
        # score to the same value, and top-k's choice among ties is left to the backend. The factor
        # is below float32's spacing (6e-8), so it never reorders scores that differ.
        newer_first = 1 + 1e-9 * step.positions.double() / step.seen
        return (step.scores.double() * newer_first).masked_fill(step.is_recent(), KEEP)
