"""OWL (outlier-weighted layerwise sparsity): blocks with more outlier activations keep more weights."""

from __future__ import annotations

import torch

from sparsegen.prune.pruner import InputStats
from sparsegen.prune.wanda import wanda_score

OUTLIER_FACTOR = 5.0  # an entry is an outlier when its Wanda score exceeds 5x the layer mean
SPREAD = 0.08  # ratios range over target +- SPREAD


def outlier_ratio(linears: dict[str, torch.nn.Linear], stats: dict[str, InputStats]) -> float:
    """Share of a block's weights whose Wanda score exceeds OUTLIER_FACTOR x its matrix mean."""
    outliers = total = 0
    for name, linear in linears.items():
        score = wanda_score(linear.weight.data, stats[name])
        outliers += int((score > OUTLIER_FACTOR * score.mean()).sum())
        total += score.numel()
    return outliers / total


def owl_ratios(outliers: list[float], target: float) -> list[float]:
    """Per-block sparsity in [target - SPREAD, target + SPREAD], lower where outliers are more, mean = target."""
    scores = torch.tensor(outliers, dtype=torch.float64)
    span = scores.max() - scores.min()
    normalised = (scores - scores.min()) / span if span > 0 else torch.zeros_like(scores)
    ratios = target + SPREAD - 2 * SPREAD * normalised
    ratios = ratios - ratios.mean() + target
    return ratios.clamp(0.0, 0.99).tolist()
