"""GPTQ: quantize columns in order and spread each column's rounding error over the columns not yet
quantized, weighted by the inverse Hessian of the layer's inputs (the OBS update SparseGPT uses).

One block per quantization group, so each group's grid is taken from its weights after all earlier
updates. Weights that are zero on entry (pruned) are kept at zero and their change is compensated
like any other rounding error, which is how SparseGPT prunes and quantizes jointly. No activation
reordering: groups stay contiguous, as compressed-tensors stores them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.prune.pruner import InputStats, inverse_hessian_factor
from sparsegen.quant.quantizer import QuantizedWeight, Quantizer, QuantScheme, register_quantizer


@register_quantizer
@dataclass
class GPTQQuantizer(Quantizer):
    """Round column by column, spreading each error through the inverse Hessian (GPTQ)."""

    name = "gptq"
    needs_calibration = True
    needs_hessian = True

    damping: float = 0.01
    """Added to diag(H), as a share of its mean, so that H can be inverted."""

    def quantize_weight(self, weight: torch.Tensor, scheme: QuantScheme, stats: InputStats | None) -> QuantizedWeight:
        weight = weight.float().clone()
        pruned = weight == 0
        rows, cols = weight.shape
        group = scheme.group_for(cols)
        hinv = inverse_hessian_factor(stats.hessian, weight, self.damping, self.name)
        scales, zeros = [], []
        for start in range(0, cols, group):
            stop = start + group
            block, hinv_block = weight[:, start:stop].clone(), hinv[start:stop, start:stop]
            errors = torch.zeros_like(block)
            scale, zero = scheme.params(block)
            for j in range(group):
                column = block[:, j]
                rounded = scheme.fake_quantize(column, scale, zero).masked_fill(pruned[:, start + j], 0)
                error = (column - rounded) / hinv_block[j, j]
                block[:, j:] -= error[:, None] * hinv_block[j, j:][None, :]
                block[:, j] = rounded
                errors[:, j] = error
            weight[:, start:stop] = block
            weight[:, stop:] -= errors @ hinv[start:stop, stop:]
            scales.append(scale)
            zeros.append(zero)
        return QuantizedWeight(weight, torch.stack(scales, 1), torch.stack(zeros, 1), group)
