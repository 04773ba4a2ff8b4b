"""Round to nearest: each group's min-max grid, every weight to its nearest level (no data needed)."""

from __future__ import annotations

import torch

from sparsegen.prune.pruner import InputStats
from sparsegen.quant.quantizer import QuantizedWeight, Quantizer, QuantScheme, register_quantizer


@register_quantizer
class RTNQuantizer(Quantizer):
    """Each group's min-max grid, every weight to its nearest level (no calibration)."""

    name = "rtn"

    def quantize_weight(self, weight: torch.Tensor, scheme: QuantScheme, stats: InputStats | None) -> QuantizedWeight:
        group = scheme.group_for(weight.shape[1])
        groups = weight.float().unflatten(1, (-1, group))
        scale, zero = scheme.params(groups)
        values = scheme.fake_quantize(groups, scale[..., None], zero[..., None]).flatten(1)
        return QuantizedWeight(values, scale, zero, group)
