"""TEAL: every projection of a block reads, per token, only the weight rows of its largest inputs.

Each Linear (q, k, v, o, gate, up, down) keeps the top-k |x| of its input and skips the weights of
the rest; for down, whose input is h, that is the oracle's neuron choice. The weights are stored
transposed, so a kept input is one contiguous row and `embedding_bag` sums just those rows. No
calibration: a fixed k per projection keeps every step's shapes fixed (one compiled graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.base import Selector, mlp_parts, register_selector
from sparsegen.errors import SparsegenError

# Budget split: each projection's input sparsity relative to the attention projections'. Measured on
# SmolLM2-135M (docs/benchmarks.md): h tolerates twice the MLP input's sparsity at the same cost.
SPLIT = {"q_proj": 1.0, "k_proj": 1.0, "v_proj": 1.0, "o_proj": 1.0, "mlp_in": 2 / 3, "down": 4 / 3}


class InputSparseLinear(nn.Module):
    """A Linear that zeroes all but the `keep` largest-magnitude entries of each input row.

    One row (a decode step) reads only the kept inputs' weight rows; more rows run the dense
    product of the masked input, which is the same arithmetic."""

    def __init__(self, linear: nn.Linear, sparsity: float) -> None:
        super().__init__()
        self.original = linear
        self.keep = min(linear.in_features, max(1, round((1 - sparsity) * linear.in_features)))
        # split each transposed row in halves: two bags, which the two cores sum in parallel
        self.halves = 2 if linear.out_features % 2 == 0 else 1
        weight_t = linear.weight.detach().t().reshape(linear.in_features * self.halves, -1)
        self.register_buffer("weight_t", weight_t.contiguous(), persistent=False)
        # input i's part in bag b is row halves * i + b; bag b starts at b * keep
        self.register_buffer("bags", torch.arange(self.halves)[:, None], persistent=False)
        self.register_buffer("offsets", torch.arange(self.halves) * self.keep, persistent=False)

    @property
    def read_share(self) -> float:
        """Share of the weight one decode step reads."""
        return self.keep / self.original.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep == self.original.in_features:
            return self.original(x)
        rows = x.reshape(-1, x.shape[-1])
        top = rows.abs().topk(self.keep, dim=-1).indices
        kept = rows.gather(1, top)
        if rows.shape[0] == 1:
            index = (top * self.halves + self.bags).flatten()
            out = F.embedding_bag(
                index, self.weight_t, self.offsets, per_sample_weights=kept.repeat(1, self.halves)[0], mode="sum"
            )
            out = out.reshape(1, -1)
            if self.original.bias is not None:
                out = out + self.original.bias
        else:
            out = self.original(torch.zeros_like(rows).scatter_(1, top, kept))
        return out.reshape(*x.shape[:-1], -1)


@register_selector
class TealSelector(Selector):
    """TEAL-style input sparsity on every projection (per token, top-k |input|)."""

    name = "teal"
    needs_hidden = True

    def shares(self, layer: nn.Module) -> dict[str, float]:
        """Input sparsity of each projection: SPLIT scaled so that the share of the layer's weights
        skipped is `sparsity` (each capped below 1)."""
        linears = projections(layer)
        sizes = {name: linear.weight.numel() for name, linear in linears.items()}
        weighted = sum(SPLIT[_role(name)] * size for name, size in sizes.items()) / sum(sizes.values())
        return {name: min(0.95, self.sparsity * SPLIT[_role(name)] / weighted) for name in linears}

    def keep(self, x, gate_act, hidden):
        """The down projection's choice: each token's top-k |h|."""
        k = self.down.keep
        mask = torch.zeros_like(hidden, dtype=torch.bool)
        return mask.scatter_(-1, hidden.abs().topk(k, dim=-1).indices, True)

    def install(self, layer: nn.Module) -> None:
        for name, share in self.shares(layer).items():
            parent, attr = _parent(layer, name)
            setattr(parent, attr, InputSparseLinear(getattr(parent, attr), share))
            if _role(name) == "down":
                self.down = getattr(parent, attr)
        layer.mlp.selector = self


def projections(layer: nn.Module) -> dict[str, nn.Linear]:
    """A decoder layer's attention and MLP Linears by dotted name (self_attn.q_proj, mlp.down_proj, ...)."""
    attention = getattr(layer, "self_attn", None)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    if attention is None or not all(isinstance(getattr(attention, n, None), nn.Linear) for n in names):
        raise SparsegenError(
            f"{type(layer).__name__} has no self_attn with q_proj/k_proj/v_proj/o_proj Linears: TEAL cannot "
            "sparsify its inputs"
        )
    linears = {f"self_attn.{n}": getattr(attention, n) for n in names}
    parts = mlp_parts(layer.mlp)
    for part in ("gate", "up", "down"):
        linear = getattr(parts, part)
        if linear is not None:
            attr = next(n for n, m in layer.mlp.named_children() if m is linear)
            linears[f"mlp.{attr}"] = linear
    return linears


def uninstall(layer: nn.Module) -> None:
    """Put back every Linear a TealSelector wrapped."""
    for name, module in list(layer.named_modules()):
        if isinstance(module, InputSparseLinear):
            parent, attr = _parent(layer, name)
            setattr(parent, attr, module.original)
    layer.mlp.__dict__.pop("selector", None)


def _role(name: str) -> str:
    attr = name.rsplit(".", 1)[1]
    if name.startswith("self_attn."):
        return attr
    return "down" if attr in ("down_proj", "fc2") else "mlp_in"


def _parent(layer: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, attr = name.rsplit(".", 1)
    return layer.get_submodule(path), attr
