"""CATS: keep the neurons whose |act(gate(x))| exceeds a per-layer threshold, calibrated so that the
target share of neurons falls below it; up and down then run only for the kept ones."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.contextual.selector import LayerStats, Selector, register_selector


@register_selector
@dataclass
class ThresholdSelector(Selector):
    """CATS-style gate threshold, per layer."""

    name = "threshold"
    needs_gate = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.threshold = torch.tensor(-1.0)  # keeps everything until calibrated

    def calibrate(self, stats: LayerStats) -> None:
        values = stats.gate_act.abs().flatten().float()
        rank = int(self.sparsity * values.numel())
        self.threshold = values.kthvalue(rank).values if rank else torch.tensor(-1.0)

    def keep(self, x, gate_act, hidden):
        return gate_act.abs() > self.threshold

    def state(self):
        return {"threshold": self.threshold}
