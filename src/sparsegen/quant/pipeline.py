"""Quantize every decoder Linear layer by layer, as pruning does (GPTQ calibrates each block on the
outputs of the quantized blocks before it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from sparsegen.distributed import share_of
from sparsegen.errors import SparsegenError
from sparsegen.layerwise import InputStats, capture_inputs, rewrite_layerwise
from sparsegen.layerwise_blocks import IN_MEMORY, Blocks
from sparsegen.models import decoder_layers, require_float_linears
from sparsegen.quant.checkpoint import block_codec, save_quantized
from sparsegen.quant.packed import pack_quantized, say_unpacked
from sparsegen.quant.quantizer import Grid, QuantReport, QuantScheme, default_group_size, make_quantizer
from sparsegen.registry import settings_of


def quantize(
    model: nn.Module,
    method: str = "rtn",
    bits: int = 4,
    group_size: int | None = None,
    symmetric: bool = False,
    calibration: torch.Tensor | None = None,
    batch: int = 8,
    progress: bool = True,
    pack: bool = False,
    blocks: Blocks = IN_MEMORY,
    **settings,
) -> QuantReport:
    """Quantize the Linear weights of `model`'s decoder blocks in place (weight-only); return a report.

    `group_size` defaults to 128 inputs a scale up to 4 bits and one scale a row above (0).
    The weights become their dequantized values, so the model runs as before; `report.grids` keeps
    the integers' scales for `save_quantized`. Zeros (pruned weights) stay zero. GPTQ needs
    `calibration` ids [n_samples, seqlen]. Further keywords are the quantizer's settings (e.g.
    GPTQ's `damping`), recorded in the report and the checkpoint. With `pack`, the layers then
    become packed integer layers run by the weight-only kernels (`quant.packed`), as a saved
    checkpoint loads.
    """
    require_float_linears(model, "quantize")
    group_size = default_group_size(bits) if group_size is None else group_size
    scheme = QuantScheme(bits, group_size, symmetric)
    quantizer = make_quantizer(method, **settings)
    if quantizer.needs_calibration and (calibration is None or calibration.dim() != 2):
        raise SparsegenError(f"{method} needs calibration token ids [n_samples, seqlen]")
    n_samples, seqlen = calibration.shape if quantizer.needs_calibration else (0, 0)
    report = QuantReport(method, bits, group_size, symmetric, n_samples, seqlen, settings=settings_of(quantizer))
    started = time.perf_counter()
    layers = decoder_layers(model)
    prefix = _layers_prefix(model, layers)
    inputs, kwargs, dtype = (
        capture_inputs(model, share_of(calibration), batch, blocks_device=blocks.device)
        if quantizer.needs_calibration
        else (None, None, None)
    )
    quantize_linear, record = _linear_steps(quantizer, scheme, report, prefix)
    desc = f"{method} int{bits} g{group_size}"
    rewrite_layerwise(
        layers,
        quantize_linear,
        record,
        inputs,
        kwargs,
        dtype,
        quantizer.needs_hessian,
        desc,
        progress,
        blocks,
        block_codec(report, prefix),
    )
    report.seconds = time.perf_counter() - started
    if pack:
        say_unpacked(pack_quantized(model, report.grids, scheme))
    return report


def _linear_steps(quantizer, scheme: QuantScheme, report: QuantReport, prefix: str) -> tuple[Callable, Callable]:
    """`rewrite_layerwise`'s two callbacks for `quantize`: quantize one Linear in place (its grid
    returned), then record that grid and the layer's group size in `report` under its full name."""

    def quantize_linear(i: int, name: str, linear: nn.Linear, stats: InputStats | None) -> Grid:
        result = quantizer.quantize_weight(linear.weight.data, scheme, stats)
        linear.weight.data.copy_(result.weight.to(linear.weight.dtype))
        return result.grid

    def record(i: int, name: str, linear: nn.Linear, grid: Grid | None) -> None:
        if grid is not None:  # None: written by an interrupted run
            report.grids[f"{prefix}.{i}.{name}"] = grid
        report.group_sizes[name.rsplit(".", 1)[-1]] = scheme.group_for(linear.in_features)

    return quantize_linear, record


def _layers_prefix(model: nn.Module, layers: nn.ModuleList) -> str:
    return next(name for name, module in model.named_modules() if module is layers)


def save_pruned_quantized(model: nn.Module, tokenizer, out: str | Path, pruned) -> Path:
    """Save a quantized model that was just pruned: its weights re-quantized by RTN with the scheme
    its config records (pruned zeros stay zero), its sparsity recorded beside the quantization."""
    from sparsegen.prune.checkpoint import sparsity_config  # quant builds on prune: imported here

    settings = model.config.sparsegen_quantization
    report = quantize(model, "rtn", settings["bits"], settings["group_size"], settings["symmetric"], progress=False)
    model.config.sparsity_config = sparsity_config(pruned, compressed=False)
    return save_quantized(model, tokenizer, out, report)
