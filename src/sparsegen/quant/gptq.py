"""GPTQ: quantize columns in order and spread each column's rounding error over the columns not yet
quantized, weighted by the inverse Hessian of the layer's inputs (the OBS update SparseGPT uses).

One block per quantization group, so each group's grid is taken from its weights after all earlier
updates. Weights that are zero on entry (pruned) are kept at zero and their change is compensated
like any other rounding error, which is how SparseGPT prunes and quantizes jointly. No activation
reordering: groups stay contiguous, as compressed-tensors stores them.
"""

from __future__ import annotations

import torch

from sparsegen.prune.base import InputStats, inverse_hessian_factor
from sparsegen.quant.base import QuantizedWeight, Quantizer, QuantScheme, register_quantizer


@register_quantizer
class GPTQQuantizer(Quantizer):
    name = "gptq"
    needs_calibration = True
    needs_hessian = True

    def __init__(self, damping: float = 0.01) -> None:
        self.damping = damping

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
