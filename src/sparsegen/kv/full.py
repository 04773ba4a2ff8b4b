"""Full cache: nothing is evicted (the dense baseline, through the same machinery)."""

from __future__ import annotations

import torch

from sparsegen.kv.base import Policy, Sizes, register_policy


@register_policy
class FullPolicy(Policy):
    name = "full"

    def __init__(self) -> None:
        super().__init__()

    def sizes(self, prompt_length: int) -> Sizes | None:
        return None

    def priority(self, positions, scores, length, sizes) -> torch.Tensor:  # never called: unbounded
        raise AssertionError("the full policy never evicts")

    def describe(self) -> str:
        return "full"
