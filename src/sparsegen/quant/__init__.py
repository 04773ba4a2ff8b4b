"""Weight quantization that composes with sparsity: round-to-nearest and GPTQ, int2-int8 per group."""

import importlib
import pkgutil

from sparsegen.quant.pipeline import quantize
from sparsegen.quant.quantizer import QUANTIZERS, QuantizedWeight, Quantizer, QuantReport, QuantScheme, make_quantizer

# Every module of this package is imported, so a quantizer registers itself by existing as a file;
# not the GGUF block layers (they register nothing, and their `gguf` package stays off the load path
# until a GGUF file is loaded).
for _module in pkgutil.iter_modules(__path__):
    if _module.name != "gguf_blocks":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["QUANTIZERS", "QuantReport", "QuantScheme", "QuantizedWeight", "Quantizer", "make_quantizer", "quantize"]
