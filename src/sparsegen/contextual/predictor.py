"""Deja Vu's predictor (Algorithm 1): a low-rank two-layer network per layer, trained on calibration
tokens to tell from the MLP's input which neurons will matter; each token keeps the top-k scores.

Labels are each token's top-k neurons by |h| (SwiGLU has no exact zeros, so "mattered" means the
largest contributions, the oracle's choice); the loss is binary cross-entropy. Recall of the
oracle's set on held-out calibration tokens is kept per layer. The predictor reads the MLP's own
input, not the previous layer's (no lookahead: on a CPU, which runs layers in order, lookahead
buys no overlap).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparsegen.contextual.base import LayerStats, Selector, register_selector


@register_selector
class PredictorSelector(Selector):
    """Deja Vu: a low-rank predictor of each token's top neurons, from the MLP input."""

    name = "predictor"

    def __init__(self, sparsity: float, rank: int = 128, steps: int = 200, lr: float = 3e-3, seed: int = 0) -> None:
        super().__init__(sparsity)
        self.rank, self.steps, self.lr, self.seed = rank, steps, lr, seed
        self.down: torch.Tensor | None = None  # [hidden_size, rank]
        self.up: torch.Tensor | None = None  # [rank, neurons]
        self.recall = torch.tensor(float("nan"))

    def _k(self, neurons: int) -> int:
        return max(1, round((1 - self.sparsity) * neurons))

    def _labels(self, hidden: torch.Tensor) -> torch.Tensor:
        k = self._k(hidden.shape[-1])
        labels = torch.zeros_like(hidden, dtype=torch.float32)
        return labels.scatter_(-1, hidden.float().abs().topk(k, dim=-1).indices, 1.0)

    def calibrate(self, stats: LayerStats) -> None:
        if self.sparsity == 0:  # every neuron kept: nothing to predict
            self.down, self.up = torch.zeros(stats.inputs.shape[1], 1), torch.zeros(1, stats.hidden.shape[1])
            self.recall = torch.tensor(1.0)
            return
        inputs, labels = stats.inputs.float(), self._labels(stats.hidden)
        split = max(1, int(0.9 * len(inputs)))
        generator = torch.Generator().manual_seed(self.seed)
        hidden_size, neurons = inputs.shape[1], labels.shape[1]
        down = (torch.randn(hidden_size, self.rank, generator=generator) / hidden_size**0.5).requires_grad_()
        up = (torch.randn(self.rank, neurons, generator=generator) / self.rank**0.5).requires_grad_()
        optimizer = torch.optim.Adam([down, up], lr=self.lr)
        positive = labels[:split].mean()
        weight = (1 - positive) / positive  # rare positives weigh as much as the many negatives
        with torch.enable_grad():
            for _ in range(self.steps):
                logits = inputs[:split] @ down @ up
                loss = F.binary_cross_entropy_with_logits(logits, labels[:split], pos_weight=weight)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        self.down, self.up = down.detach(), up.detach()
        held_out = slice(split, None) if split < len(inputs) else slice(None)
        chosen = self.keep(inputs[held_out], None, None)
        self.recall = (chosen & labels[held_out].bool()).sum() / labels[held_out].sum()

    def keep(self, x, gate_act, hidden):
        scores = x.float() @ self.down @ self.up
        mask = torch.zeros_like(scores, dtype=torch.bool)
        return mask.scatter_(-1, scores.topk(self._k(scores.shape[-1]), dim=-1).indices, True)

    def state(self):
        return {"down": self.down, "up": self.up, "recall": self.recall}
