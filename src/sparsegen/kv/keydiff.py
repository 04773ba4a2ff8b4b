"""KeyDiff (Park et al. 2025, "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
Inference in Resource-Constrained Environments"): once the prompt is read, keep the keys least
like the average key direction; distinctive keys are the ones queries single out. No attention is
needed. Decoding then keeps every new token.

Score: minus the cosine similarity of each key to the mean of the held keys' unit vectors, per
KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from sparsegen.kv.policy import Policy, register_policy


@register_policy
@dataclass
class KeyDiffPolicy(Policy):
    """Compress the prompt once, keeping the keys least like the mean key (KeyDiff)."""

    name = "keydiff"
    prefill_only = True

    heavy: int | float = 256
    """Prompt tokens kept: a count, or a share of the prompt."""

    def score(self, step):
        directions = F.normalize(step.keys.float(), dim=-1)
        anchor = directions.mean(dim=2, keepdim=True)
        return -F.cosine_similarity(directions, anchor, dim=-1)

    def priority(self, step):
        return step.scores
