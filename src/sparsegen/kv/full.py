"""The full cache: nothing is evicted (the dense reference every policy is measured against)."""

from __future__ import annotations

from dataclasses import dataclass

from sparsegen.kv.policy import Policy, Sizes, register_policy


@register_policy
@dataclass
class FullPolicy(Policy):
    """Keep every token (dense)."""

    name = "full"

    def sizes(self, prompt_length: int) -> Sizes | None:
        return None

    def priority(self, step):  # never called: unbounded
        raise AssertionError("the full policy never evicts")
