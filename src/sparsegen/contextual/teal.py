"""TEAL: every projection of a block reads, per token, only the weight rows of its largest inputs.

q/k/v, o, gate/up and down each keep the top-k |x| of their input and skip the weights of the rest;
for down, whose input is h, that is the oracle's neuron choice. No calibration: a fixed k per
projection keeps every step's shapes fixed (one compiled graph). Execution: `input_sparse.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from sparsegen.contextual.input_sparse import InputSparseAttention, InputSparseMLP, input_scores
from sparsegen.contextual.parts import mlp_parts
from sparsegen.contextual.selector import Selector, register_selector
from sparsegen.errors import SparsegenError

# Budget split: each input's sparsity relative to the attention projections'. Measured on
# SmolLM2-135M (docs/benchmarks.md): h tolerates twice the MLP input's sparsity at the same cost.
SPLIT = {"qkv": 1.0, "o": 1.0, "mlp_in": 2 / 3, "down": 4 / 3}
BATCH_SELECTIONS = ("per-row", "shared")


@register_selector
@dataclass
class TealSelector(Selector):
    """TEAL-style input sparsity on every projection (per token, top-k |input|)."""

    name = "teal"
    needs_hidden = True
    weighted: ClassVar[bool] = False  # scores |x| alone (WINA, its subclass, weighs them)

    batch_selection: str = "per-row"
    """On a GPU, how the rows of a batch read the weights: "per-row" (each its own kept inputs'
    rows: a row equals its single-row run, and shapes stay fixed for a CUDA graph) or "shared"
    (the union of the rows' selections read once, each row's unkept inputs zeroed)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.batch_selection not in BATCH_SELECTIONS:
            raise SparsegenError(
                f"batch_selection must be one of {', '.join(BATCH_SELECTIONS)}, got {self.batch_selection!r}"
            )

    def shares(self, layer: nn.Module) -> dict[str, float]:
        """Input sparsity of each group of projections: SPLIT scaled so that the share of the
        layer's weights skipped is `sparsity` (each capped below 1)."""
        sizes = {
            group: sum(linear.weight.numel() for linear in linears)
            for group, linears in projection_groups(layer).items()
        }
        weighted = sum(SPLIT[group] * size for group, size in sizes.items()) / sum(sizes.values())
        return {group: min(0.95, self.sparsity * SPLIT[group] / weighted) for group in sizes}

    def keep(self, x, gate_act, hidden):
        """The down projection's choice: each token's top-k scores of h."""
        mask = torch.zeros_like(hidden, dtype=torch.bool)
        top = input_scores(hidden, self.down_norms).topk(self.down_keep, dim=-1, sorted=False).indices
        return mask.scatter_(-1, top, True)

    def install(self, layer: nn.Module) -> None:
        shares, shared, weighted = self.shares(layer), self.batch_selection == "shared", self.weighted
        layer.self_attn = InputSparseAttention(layer.self_attn, shares["qkv"], shares["o"], shared, weighted)
        parts = mlp_parts(layer.mlp)
        layer.mlp = InputSparseMLP(layer.mlp, parts, self, shares["mlp_in"], shares["down"], shared, weighted)
        self.down_keep, self.down_norms = layer.mlp.down.keep, layer.mlp.down.input_norms


def projection_groups(layer: nn.Module) -> dict[str, list[nn.Linear]]:
    """A decoder layer's projections, grouped by the input they read."""
    attention = getattr(layer, "self_attn", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attention is None or not all(type(getattr(attention, n, None)) is nn.Linear for n in names):
        raise SparsegenError(
            f"{type(layer).__name__} has no self_attn with q_proj/k_proj/v_proj/o_proj Linears: TEAL cannot "
            "sparsify its inputs"
        )
    parts = mlp_parts(layer.mlp)
    return {
        "qkv": [attention.q_proj, attention.k_proj, attention.v_proj],
        "o": [attention.o_proj],
        "mlp_in": [parts.up] if parts.gate is None else [parts.gate, parts.up],
        "down": [parts.down],
    }
