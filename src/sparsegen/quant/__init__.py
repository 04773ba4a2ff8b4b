"""Weight quantization that composes with sparsity: round-to-nearest and GPTQ, int2-int8 per group."""

from sparsegen.quant import gptq, rtn  # noqa: F401  (register quantizers)
from sparsegen.quant.base import QUANTIZERS, QuantizedWeight, Quantizer, QuantScheme, make_quantizer
from sparsegen.quant.pipeline import QuantReport, quantize

__all__ = ["QUANTIZERS", "QuantReport", "QuantScheme", "QuantizedWeight", "Quantizer", "make_quantizer", "quantize"]
