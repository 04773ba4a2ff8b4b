"""The standard layer-by-layer protocol: calibrate each decoder block on the outputs of the pruned
blocks before it, prune its Linear layers, move on. Memory holds one block's activations."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
from sparsegen.models import decoder_layers
from sparsegen.prune.base import InputStats, Pattern, make_pruner
from sparsegen.prune.owl import outlier_ratio, owl_ratios
from sparsegen.report import say_estimate


@dataclass
class PruneReport:
    """What was done: per-Linear sparsity, timings, and the settings (stored in checkpoints)."""

    method: str
    pattern: str
    sparsity: float
    owl: bool
    n_samples: int
    seqlen: int
    layers: dict[str, float] = field(default_factory=dict)
    block_sparsity: list[float] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def overall(self) -> float:
        return sum(self.layers.values()) / len(self.layers) if self.layers else 0.0


def block_linears(block: nn.Module) -> dict[str, nn.Linear]:
    return {name: module for name, module in block.named_modules() if isinstance(module, nn.Linear)}


class _Stop(Exception):
    pass


def _capture(model: nn.Module, layers: nn.ModuleList, samples: torch.Tensor, batch: int):
    """Inputs of block 0 for every sample batch, and the keyword arguments each block is called with."""
    inputs: list[torch.Tensor] = []
    block_kwargs: list[dict] = [{} for _ in layers]

    def first(module, args, kwargs):
        inputs.append(args[0] if args else kwargs["hidden_states"])
        raise _Stop

    def record(index):
        def hook(module, args, kwargs):
            if not block_kwargs[index]:
                block_kwargs[index] = {k: v for k, v in kwargs.items() if k != "hidden_states"}

        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    with torch.no_grad():
        model(samples[:1], use_cache=False)  # one sample's full pass records every block's arguments
        for handle in handles:
            handle.remove()
        handle = layers[0].register_forward_pre_hook(first, with_kwargs=True)
        try:
            for start in range(0, samples.shape[0], batch):
                with contextlib.suppress(_Stop):
                    model(samples[start : start + batch], use_cache=False)
        finally:
            handle.remove()
    return inputs, block_kwargs


def fast_calibration_dtype(device: torch.device) -> torch.dtype | None:
    """bfloat16 where the hardware computes it natively (CUDA, or CPUs with AVX-512 BF16 / AMX), else None.

    Calibration forwards only produce statistics and the next block's inputs; the published
    methods run them in half precision on GPUs. Statistics are still accumulated in fp32.
    """
    if device.type == "cuda":
        return torch.bfloat16
    if device.type == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.bfloat16
    return None


def _autocast(device: torch.device, dtype: torch.dtype | None):
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def _run_block(block: nn.Module, inputs: list[torch.Tensor], kwargs: dict, dtype: torch.dtype | None):
    outputs = []
    with torch.no_grad(), _autocast(inputs[0].device, dtype):
        for hidden in inputs:
            out = block(hidden, **kwargs)
            outputs.append(out[0] if isinstance(out, tuple) else out)
    return outputs


def _collect(block: nn.Module, inputs: list[torch.Tensor], kwargs: dict, dtype: torch.dtype | None, need_hessian: bool):
    """Run the (dense) block over the inputs, accumulating each Linear's input statistics."""
    linears = block_linears(block)
    stats = {name: InputStats(linear.in_features, need_hessian) for name, linear in linears.items()}
    handles = [
        linear.register_forward_hook(lambda m, args, out, s=stats[name]: s.add(args[0]))
        for name, linear in linears.items()
    ]
    try:
        _run_block(block, inputs, kwargs, dtype)
    finally:
        for handle in handles:
            handle.remove()
    return linears, stats


def calibration_inputs(
    model: nn.Module, calibration: torch.Tensor, batch: int = 8, calibration_dtype: torch.dtype | None | str = "auto"
) -> tuple[list[torch.Tensor], list[dict], torch.dtype | None]:
    """Inputs of block 0 for the calibration ids, each block's call arguments, and the forward dtype."""
    device = next(model.parameters()).device
    dtype = fast_calibration_dtype(device) if calibration_dtype == "auto" else calibration_dtype
    inputs, kwargs = _capture(model, decoder_layers(model), calibration.to(device), batch)
    return inputs, kwargs, dtype


def rewrite_layerwise(
    layers: nn.ModuleList,
    rewrite: Callable[[int, str, nn.Linear, InputStats | None], None],
    inputs: list[torch.Tensor] | None,
    kwargs: list[dict] | None,
    dtype: torch.dtype | None,
    need_hessian: bool,
    desc: str,
    progress: bool = True,
) -> None:
    """Call `rewrite(block_index, name, linear, stats)` on every Linear of every block, in order.

    With calibration `inputs`, each block's statistics come from its dense forward over the
    outputs of the already rewritten blocks before it (the standard sequential protocol);
    without, `stats` is None.
    """
    started = time.perf_counter()
    for i, block in enumerate(tqdm(layers, desc=desc, unit="block", disable=not progress)):
        if i == 1 and progress:
            say_estimate(time.perf_counter() - started, len(layers), "block", "--n-samples and --seqlen scale it")
        if inputs is None:
            linears, stats = block_linears(block), {}
        else:
            linears, stats = _collect(block, inputs, kwargs[i], dtype, need_hessian)
        for name, linear in linears.items():
            rewrite(i, name, linear, stats.get(name))
        if inputs is not None and i + 1 < len(layers):
            stats.clear()
            inputs = _run_block(block, inputs, kwargs[i], dtype)


def prune(
    model: nn.Module,
    method: str = "wanda",
    sparsity: float = 0.5,
    pattern: str | None = None,
    calibration: torch.Tensor | None = None,
    owl: bool = False,
    batch: int = 8,
    calibration_dtype: torch.dtype | None | str = "auto",
    progress: bool = True,
    **options,
) -> PruneReport:
    """Prune the Linear layers of `model`'s decoder blocks in place; return a report.

    `pattern` is None/"unstructured" (each layer at `sparsity`) or "N:M" ("2:4", "4:8"). Methods
    that need data take `calibration`, a LongTensor [n_samples, seqlen]. `owl=True` gives each
    block its own ratio from its share of outlier activations (OWL), averaging to `sparsity`.
    `calibration_dtype` is the autocast dtype of the calibration forwards: "auto" is bfloat16
    where the hardware computes it natively (see `fast_calibration_dtype`), None the model's dtype.
    Further keywords go to the pruner (e.g. `mask_scope="block"` for SparseGPT).
    """
    shape = Pattern.parse(sparsity, pattern)
    from sparsegen.quant.packed import require_float_linears  # quant builds on prune: imported here

    require_float_linears(model, "prune")
    pruner = make_pruner(method, **options)
    layers = decoder_layers(model)
    needs_data = pruner.needs_calibration or owl
    if needs_data and (calibration is None or calibration.dim() != 2):
        raise SparsegenError(f"{method}{' with OWL' if owl else ''} needs calibration token ids [n_samples, seqlen]")
    if owl and shape.is_nm:
        raise SparsegenError("OWL sets a ratio per layer; it does not apply to N:M patterns")
    n_samples, seqlen = calibration.shape if needs_data else (0, 0)
    report = PruneReport(method, str(shape), shape.sparsity, owl, n_samples, seqlen)
    started = time.perf_counter()
    ratios = [shape.sparsity] * len(layers)
    inputs, kwargs, dtype = (
        calibration_inputs(model, calibration, batch, calibration_dtype) if needs_data else (None, None, None)
    )
    if owl:
        scores, hidden = [], inputs
        for i, block in enumerate(tqdm(layers, desc="OWL outliers", disable=not progress)):
            linears, stats = _collect(block, hidden, kwargs[i], dtype, need_hessian=False)
            scores.append(outlier_ratio(linears, stats))
            hidden = _run_block(block, hidden, kwargs[i], dtype)
        ratios = owl_ratios(scores, shape.sparsity)
    block_counts: list[list[int]] = [[0, 0] for _ in layers]

    def prune_linear(i: int, name: str, linear: nn.Linear, stats: InputStats | None) -> None:
        pruned = pruner.prune_weight(linear.weight.data, Pattern(ratios[i], shape.n, shape.m), stats)
        linear.weight.data.copy_(pruned.to(linear.weight.dtype))
        zero = int((linear.weight.data == 0).sum())
        report.layers[f"{i}.{name}"] = zero / linear.weight.numel()
        block_counts[i][0] += zero
        block_counts[i][1] += linear.weight.numel()

    rewrite_layerwise(layers, prune_linear, inputs, kwargs, dtype, pruner.needs_hessian, f"{method} {shape}", progress)
    report.block_sparsity = [zeros / total for zeros, total in block_counts]
    report.seconds = time.perf_counter() - started
    return report
