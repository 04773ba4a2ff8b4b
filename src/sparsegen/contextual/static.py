"""Static: the same neurons for every token, those with the largest mean |h| on calibration text
(Deja Vu's input-independent baseline). The kept rows are gathered once, so it runs as a smaller
dense MLP."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.contextual.selector import LayerStats, Selector, register_selector


@register_selector
@dataclass
class StaticSelector(Selector):
    """One fixed set per layer: the neurons with the largest mean |h| in calibration."""

    name = "static"
    needs_gate = False

    def __post_init__(self) -> None:
        super().__post_init__()
        self.kept: torch.Tensor | None = None

    def calibrate(self, stats: LayerStats) -> None:
        self.neurons = neurons = stats.hidden.shape[-1]
        k = round((1 - self.sparsity) * neurons)
        self.kept = stats.hidden.float().abs().mean(0).topk(k).indices.sort().values

    def keep(self, x, gate_act, hidden):
        mask = torch.zeros(x.shape[0], self.neurons, dtype=torch.bool, device=x.device)
        mask[:, self.kept] = True
        return mask

    def state(self):
        return {"kept": self.kept, "neurons": torch.tensor(self.neurons)}

    def load_state(self, state):
        self.kept, self.neurons = state["kept"], int(state["neurons"])
