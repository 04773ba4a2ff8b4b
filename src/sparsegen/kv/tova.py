"""TOVA (Oren et al. 2024, "Transformers are Multi-State RNNs"): when the cache is full, drop the
token the newest query attends to least.

The score is the last query's attention alone (not a running sum): each step rewrites it, summed
over the query heads of each KV head's group. No recent window and no sinks: every held token,
the newest included, competes on that one score.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.policy import Policy, register_policy


@register_policy
@dataclass
class TOVAPolicy(Policy):
    """Keep what the newest query attends to most (TOVA)."""

    name = "tova"

    heavy: int | float = 256
    """Tokens kept: a count, or a share of the prompt."""

    def score(self, step):
        return step.received(last=1)

    def priority(self, step):
        return step.scores
