"""Local window: keep only the `recent` newest tokens (collapses once the first tokens leave)."""

from __future__ import annotations

import torch

from sparsegen.kv.base import Policy, register_policy


@register_policy
class WindowPolicy(Policy):
    name = "window"

    def __init__(self, recent: int | float = 256) -> None:
        super().__init__(recent=recent)

    def priority(self, positions, scores, length, sizes) -> torch.Tensor:
        return positions.float()
