"""Magnitude pruning: drop the smallest |W|, one threshold per matrix (or per N:M group)."""

from __future__ import annotations

import torch

from sparsegen.prune.pruner import InputStats, Pattern, Pruner, mask_lowest, register_pruner


@register_pruner
class MagnitudePruner(Pruner):
    """Drop the smallest |W| of each matrix (no calibration)."""

    name = "magnitude"
    needs_calibration = False

    def prune_weight(self, weight: torch.Tensor, pattern: Pattern, stats: InputStats | None) -> torch.Tensor:
        weight = weight.float()
        return weight.masked_fill(mask_lowest(weight.abs(), pattern, per_row=False), 0)
