"""Wanda: score |W_ij| * ||X_j||_2 and drop the lowest within each output row (no weight update)."""

from __future__ import annotations

import torch

from sparsegen.prune.pruner import InputStats, Pattern, Pruner, mask_lowest, register_pruner


def wanda_score(weight: torch.Tensor, stats: InputStats) -> torch.Tensor:
    return weight.float().abs() * stats.sq_norm.sqrt().float()[None, :]


@register_pruner
class WandaPruner(Pruner):
    """Drop the lowest |W| * ||X|| within each output row (Wanda)."""

    name = "wanda"

    def prune_weight(self, weight: torch.Tensor, pattern: Pattern, stats: InputStats | None) -> torch.Tensor:
        weight = weight.float()
        return weight.masked_fill(mask_lowest(wanda_score(weight, stats), pattern, per_row=True), 0)
