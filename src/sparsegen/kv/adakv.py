"""AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference"): a layer's heads share one budget. Instead of each head keeping its
own top tokens, the layer keeps the highest-scored tokens of all its heads together, so a head
whose attention is concentrated gives slots to one whose attention is spread. A safeguard keeps
each head's own top `alpha` share of the per-head budget.

`AdaptiveHeads` turns any prefill-only scorer into its head-adaptive form (a mixin over the
scorer's class); `adakv` is it over Expected Attention, the pairing that leads kvpress's
leaderboard. The layer holds the shared budget in exactly its bytes (`kv.ragged`).
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.errors import SparsegenError
from sparsegen.kv.expected_attention import ExpectedAttentionPolicy
from sparsegen.kv.policy import KEEP, register_policy


@dataclass
class AdaptiveHeads:
    """Mixin for a prefill-only policy: its layer's heads share their budget by priority."""

    head_adaptive = True

    alpha: float = 0.2
    """Share of the per-head budget every head keeps of its own best tokens (the safeguard)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.alpha <= 1:
            raise SparsegenError(f"alpha must be in [0, 1], got {self.alpha}")

    def priority(self, step):
        priority = super().priority(step)
        if self.alpha == 0:
            return priority
        guaranteed = max(1, int(self.alpha * step.sizes.budget))
        best = priority.topk(min(guaranteed, priority.shape[-1]), dim=-1).indices
        return priority.scatter(-1, best, KEEP)


@register_policy
@dataclass
class AdaKVPolicy(AdaptiveHeads, ExpectedAttentionPolicy):
    """Expected Attention's scores with one budget per layer shared by its heads (AdaKV)."""

    name = "adakv"
