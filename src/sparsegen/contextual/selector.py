"""What a neuron selector is: per token, which MLP neurons to compute.

A neuron is one row of gate/up (one column of down). A selector sees the MLP input x [t, hidden]
and, when it asks for it, the activated gate act(gate(x)) [t, neurons], and returns a keep mask
[t, neurons]. Per-layer settings (thresholds, fixed sets) come from calibration, which each
selector owns: `calibrate(stats)` receives the layer's calibration statistics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from sparsegen.contextual.mlp import SparseMLP
from sparsegen.contextual.parts import mlp_parts
from sparsegen.errors import SparsegenError
from sparsegen.registry import Registry

SELECTORS = Registry("neuron selector", "selector")
register_selector = SELECTORS.register


@dataclass
class LayerStats:
    """Calibration statistics of one MLP over a sample of tokens: its inputs [tokens, hidden_size],
    activated gates (pre-down activations for plain MLPs), h, the input of down [tokens, neurons],
    and, when lookahead is measured, the previous layer's MLP inputs for the same tokens (else None)."""

    inputs: torch.Tensor
    gate_act: torch.Tensor
    hidden: torch.Tensor
    previous: torch.Tensor | None = None


@dataclass
class Selector(ABC):
    """Base class: a dataclass whose init fields are the selector's settings (what calibration
    sets is not: it is `state`); set `name`, `needs_gate` (the mask depends on act(gate(x)), which
    is then computed for every neuron) or `needs_hidden` (it depends on h itself: a quality
    reference that cannot be faster); implement `keep` and, if it has per-layer settings,
    `calibrate`. `install` puts the selector into a decoder layer (by default: its MLP becomes a
    `SparseMLP`)."""

    name: ClassVar[str]
    needs_gate: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False

    sparsity: float = 0.5
    """Share of the MLP's neurons each token skips."""

    def __post_init__(self) -> None:
        checked_sparsity(self.sparsity)

    def calibrate(self, stats: LayerStats) -> None:
        """Set the layer's settings from calibration statistics (default: nothing to set)."""
        return None

    @abstractmethod
    def keep(self, x: torch.Tensor, gate_act: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """Boolean keep mask [t, neurons] for the MLP inputs `x` [t, hidden_size] (`gate_act`, `hidden`
        [t, neurons] are given when the selector declared it needs them)."""

    def install(self, layer: nn.Module) -> None:
        original = layer.mlp
        layer.mlp = SparseMLP(mlp_parts(original), self)
        layer.mlp.original = original

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors to save with the predictors file (per-layer settings)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def faster_selectors() -> list[str]:
    """The selectors whose choice needs no h, so their MLP can run gathered: those a speed bench
    compares against dense."""
    return sorted(name for name, cls in SELECTORS.items() if not cls.needs_hidden)


def checked_sparsity(sparsity: float, what: str = "sparsity") -> float:
    if not 0 <= sparsity < 1:
        raise SparsegenError(f"{what} must be in [0, 1), got {sparsity}")
    return sparsity


def make_selector(name: str, sparsity: float, **settings) -> Selector:
    """A registered selector by name with its settings (e.g. the predictor's `rank`)."""
    return SELECTORS.make(name, sparsity=sparsity, **settings)
