"""Key norm (Devoto et al. 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache
Compression"): once the prompt is read, keep the tokens whose keys have the smallest L2 norm,
which the paper finds are the ones that receive the most attention; no attention is needed.
Decoding then keeps every new token.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.policy import Policy, register_policy


@register_policy
@dataclass
class KeyNormPolicy(Policy):
    """Compress the prompt once, keeping low-norm keys (key norm)."""

    name = "knorm"
    prefill_only = True

    heavy: int | float = 256
    """Prompt tokens kept: a count, or a share of the prompt."""

    def priority(self, step):
        return -step.keys.float().norm(dim=-1)
