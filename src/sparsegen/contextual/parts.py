"""The projections of a decoder layer's MLP, found by name, and the activations they compute:
what selectors, their sparse MLPs and TEAL all read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from sparsegen.errors import SparsegenError


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


class NeuronChoice(Protocol):
    """What a sparse MLP asks of its selector (`contextual.selector.Selector` is one)."""

    needs_gate: bool
    needs_hidden: bool

    def keep(self, x: torch.Tensor, gate_act: torch.Tensor | None, hidden: torch.Tensor | None) -> torch.Tensor: ...
