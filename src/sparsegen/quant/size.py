"""Bits per weight of the quantized decoder Linears, counted honestly against fp16's 16.

`stored`: compressed-tensors' packed layout, as written: every weight at `bits`, plus an fp16
scale and (asymmetric) a `bits`-wide zero point per group; pruned zeros cost as much as any
weight. `sparse_packed`: what a bitmask layout would need (1 bit per weight for the mask, `bits`
per non-zero, the same scales); computed, not a format sparsegen writes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from sparsegen.layerwise import block_linears
from sparsegen.models import decoder_layers
from sparsegen.quant.quantizer import QuantScheme


@dataclass(frozen=True)
class BitsPerWeight:
    stored: float
    sparse_packed: float
    density: float

    @property
    def best(self) -> float:
        return min(self.stored, self.sparse_packed)

    def compression(self) -> float:
        """fp16 bits over the better of the two layouts."""
        return 16 / self.best


def bits_per_weight(model: nn.Module, scheme: QuantScheme | None) -> BitsPerWeight:
    """Bits per weight of `model`'s decoder Linears under `scheme` (None: unquantized fp16)."""
    weights = nonzero = groups = 0
    for block in decoder_layers(model):
        for linear in block_linears(block).values():
            rows, cols = linear.weight.shape
            weights += rows * cols
            nonzero += int((linear.weight != 0).sum())
            groups += rows * cols // scheme.group_for(cols) if scheme is not None else 0
    density = nonzero / weights
    bits = scheme.bits if scheme is not None else 16
    per_group = 0 if scheme is None else 16 + (0 if scheme.symmetric else scheme.bits)
    stored = bits + per_group * groups / weights
    return BitsPerWeight(stored, density * bits + 1 + per_group * groups / weights, density)
