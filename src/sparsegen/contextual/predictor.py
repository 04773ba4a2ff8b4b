"""Deja Vu's predictor (Algorithm 1): a low-rank two-layer network per layer, trained on calibration
tokens to tell from the MLP's input which neurons will matter; each token keeps the top-k scores.

Labels are each token's top-k neurons by |h| (SwiGLU has no exact zeros, so "mattered" means the
largest contributions, the oracle's choice); the loss is binary cross-entropy. Recall of the
oracle's set on held-out calibration tokens is kept per layer (precision equals it: both sets have
k members), and so is the recall of a lookahead predictor trained on the previous layer's input.
Execution reads the layer's own input: on a CPU, which runs layers in order, lookahead buys no
overlap, only a loss of recall.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparsegen.contextual.selector import LayerStats, Selector, register_selector


@dataclass
class LowRank:
    """scores = x @ down @ up: a two-layer network without a nonlinearity, as in Deja Vu."""

    down: torch.Tensor  # [inputs, rank]
    up: torch.Tensor  # [rank, outputs]

    def top(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Boolean mask [t, outputs] of each row's k highest scores."""
        scores = x.float() @ self.down @ self.up
        top = scores.topk(k, dim=-1, sorted=False).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


def top_k_labels(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """1.0 where an entry is among its row's k largest, else 0.0."""
    labels = torch.zeros_like(magnitude, dtype=torch.float32)
    return labels.scatter_(-1, magnitude.float().topk(k, dim=-1, sorted=False).indices, 1.0)


def fit_low_rank(
    inputs: torch.Tensor, labels: torch.Tensor, rank: int, steps: int, lr: float, seed: int
) -> tuple[LowRank, float]:
    """Train on the first 90% of the tokens with weighted BCE; returns the predictor and its recall
    of the labelled top-k on the last 10%."""
    inputs = inputs.float()
    split = max(1, int(0.9 * len(inputs)))
    generator = torch.Generator().manual_seed(seed)
    width, outputs = inputs.shape[1], labels.shape[1]
    # drawn on the CPU, so that a seed starts the same predictor on every device
    down = (torch.randn(width, rank, generator=generator) / width**0.5).to(inputs.device).requires_grad_()
    up = (torch.randn(rank, outputs, generator=generator) / rank**0.5).to(inputs.device).requires_grad_()
    optimizer = torch.optim.Adam([down, up], lr=lr)
    positive = labels[:split].mean()
    weight = (1 - positive) / positive  # rare positives weigh as much as the many negatives
    with torch.enable_grad():
        for _ in range(steps):
            loss = F.binary_cross_entropy_with_logits(inputs[:split] @ down @ up, labels[:split], pos_weight=weight)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    predictor = LowRank(down.detach(), up.detach())
    held_out = slice(split, None) if split < len(inputs) else slice(None)
    truth = labels[held_out].bool()
    chosen = predictor.top(inputs[held_out], int(labels[0].sum().item()))
    return predictor, ((chosen & truth).sum() / truth.sum()).item()


@register_selector
@dataclass
class PredictorSelector(Selector):
    """Deja Vu: a low-rank predictor of each token's top neurons, from the MLP input."""

    name = "predictor"

    rank: int = 128
    """Width of the low-rank predictor."""
    steps: int = 200
    """Adam steps of its training."""
    lr: float = 3e-3
    """Adam's learning rate."""
    seed: int = 0
    """Seed of the predictor's initial weights."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.down: torch.Tensor | None = None  # [hidden_size, rank]
        self.up: torch.Tensor | None = None  # [rank, neurons]
        self.recall = self.lookahead_recall = torch.tensor(float("nan"))

    def _k(self, neurons: int) -> int:
        return max(1, round((1 - self.sparsity) * neurons))

    def calibrate(self, stats: LayerStats) -> None:
        if self.sparsity == 0:  # every neuron kept: nothing to predict
            device = stats.inputs.device
            self.down = torch.zeros(stats.inputs.shape[1], 1, device=device)
            self.up = torch.zeros(1, stats.hidden.shape[1], device=device)
            self.recall = self.lookahead_recall = torch.tensor(1.0)
            return
        labels = top_k_labels(stats.hidden.abs(), self._k(stats.hidden.shape[1]))
        settings = (self.rank, self.steps, self.lr, self.seed)
        own, recall = fit_low_rank(stats.inputs, labels, *settings)
        self.down, self.up, self.recall = own.down, own.up, torch.tensor(recall)
        if stats.previous is not None:
            self.lookahead_recall = torch.tensor(fit_low_rank(stats.previous, labels, *settings)[1])

    def keep(self, x, gate_act, hidden):
        return LowRank(self.down, self.up).top(x, self._k(self.up.shape[1]))

    def state(self):
        return {"down": self.down, "up": self.up, "recall": self.recall, "lookahead_recall": self.lookahead_recall}
