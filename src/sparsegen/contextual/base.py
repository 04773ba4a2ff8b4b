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

from sparsegen.errors import SparsegenError

SELECTORS: dict[str, type[Selector]] = {}


def register_selector(cls: type[Selector]) -> type[Selector]:
    SELECTORS[cls.name] = cls
    return cls


@dataclass
class MLPParts:
    """The projections of a gated (SwiGLU/GeGLU) or plain (ReLU/GELU) MLP, found by name."""

    gate: nn.Linear | None
    up: nn.Linear
    down: nn.Linear
    act: nn.Module

    @property
    def neurons(self) -> int:
        return self.up.out_features


def mlp_parts(mlp: nn.Module) -> MLPParts:
    """The MLP's projections: gate_proj/up_proj/down_proj/act_fn (gated), up_proj/down_proj or fc1/fc2."""
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None) or getattr(mlp, "act", None)
    up = getattr(mlp, "up_proj", None) or getattr(mlp, "fc1", None)
    down = getattr(mlp, "down_proj", None) or getattr(mlp, "fc2", None)
    if not (isinstance(up, nn.Linear) and isinstance(down, nn.Linear) and act is not None):
        raise SparsegenError(
            f"{type(mlp).__name__} is neither a gated MLP (gate_proj, up_proj, down_proj, act_fn) nor a plain "
            "ReLU/GELU MLP (up_proj/fc1, down_proj/fc2 and an activation): contextual sparsity cannot select "
            "its neurons"
        )
    return MLPParts(getattr(mlp, "gate_proj", None), up, down, act)


def mlp_activations(parts: MLPParts, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """act(gate(x)) (for a plain MLP, act(up(x))) and h, the input of down, for every neuron."""
    if parts.gate is None:
        hidden = parts.act(parts.up(x))
        return hidden, hidden
    gate_act = parts.act(parts.gate(x))
    return gate_act, gate_act * parts.up(x)


@dataclass
class LayerStats:
    """Calibration statistics of one MLP over a sample of tokens: its inputs [tokens, hidden_size],
    activated gates (pre-down activations for plain MLPs), h, the input of down [tokens, neurons],
    and, when lookahead is measured, the previous layer's MLP inputs for the same tokens (else None)."""

    inputs: torch.Tensor
    gate_act: torch.Tensor
    hidden: torch.Tensor
    previous: torch.Tensor | None = None


class Selector(ABC):
    """Base class: set `name`, `needs_gate` (the mask depends on act(gate(x)), which is then
    computed for every neuron) or `needs_hidden` (it depends on h itself: a quality reference that
    cannot be faster); implement `keep` and, if it has per-layer settings, `calibrate`. `install`
    puts the selector into a decoder layer (by default: its MLP becomes a `SparseMLP`)."""

    name: ClassVar[str]
    needs_gate: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False

    def __init__(self, sparsity: float) -> None:
        self.sparsity = checked_sparsity(sparsity)

    def calibrate(self, stats: LayerStats) -> None:
        """Set the layer's settings from calibration statistics (default: nothing to set)."""
        return None

    @abstractmethod
    def keep(self, x: torch.Tensor, gate_act: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor:
        """Boolean keep mask [t, neurons] for the MLP inputs `x` [t, hidden_size] (`gate_act`, `hidden`
        [t, neurons] are given when the selector declared it needs them)."""

    def install(self, layer: nn.Module) -> None:
        from sparsegen.contextual.mlp import SparseMLP

        original = layer.mlp
        layer.mlp = SparseMLP(mlp_parts(original), self)
        layer.mlp.original = original

    def state(self) -> dict[str, torch.Tensor]:
        """Tensors to save with the predictors file (per-layer settings)."""
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


def checked_sparsity(sparsity: float, what: str = "sparsity") -> float:
    if not 0 <= sparsity < 1:
        raise SparsegenError(f"{what} must be in [0, 1), got {sparsity}")
    return sparsity


def make_selector(name: str, sparsity: float, **options) -> Selector:
    if name not in SELECTORS:
        raise SparsegenError(f"unknown neuron selector {name!r}; choose one of: {', '.join(sorted(SELECTORS))}")
    return SELECTORS[name](sparsity, **options)
