"""Pruning by the standard layer-by-layer protocol (`layerwise`): calibrate each decoder block on
the outputs of the pruned blocks before it, prune its Linear layers, move on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from sparsegen.distributed import share_of
from sparsegen.errors import SparsegenError
from sparsegen.layerwise import InputStats, capture_inputs, collect_stats, rewrite_layerwise, run_block
from sparsegen.layerwise_blocks import IN_MEMORY, Blocks
from sparsegen.models import decoder_layers, require_float_linears
from sparsegen.prune.owl import outlier_ratio, owl_ratios
from sparsegen.prune.pruner import Pattern, make_pruner
from sparsegen.registry import settings_of


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
    settings: dict = field(default_factory=dict)  # the pruner's own (`registry.settings_of`)

    @property
    def overall(self) -> float:
        return sum(self.layers.values()) / len(self.layers) if self.layers else 0.0


def _check_data_and_owl(
    method: str, shape: Pattern, needs_data: bool, calibration: torch.Tensor | None, owl: bool, blocks: Blocks
) -> None:
    """`prune`'s refusals before any work: calibration missing where the method or OWL needs it, and
    OWL where it cannot run (N:M patterns, blocks streamed from disk)."""
    if needs_data and (calibration is None or calibration.dim() != 2):
        raise SparsegenError(f"{method}{' with OWL' if owl else ''} needs calibration token ids [n_samples, seqlen]")
    if owl and shape.is_nm:
        raise SparsegenError("OWL sets a ratio per layer; it does not apply to N:M patterns")
    if owl and blocks is not IN_MEMORY:
        raise SparsegenError(
            "OWL reads every block twice; it runs on a model held whole where it runs (drop --from-disk; on a GPU, "
            "one that holds the model)"
        )


def _owl_block_ratios(layers, inputs, kwargs, dtype, sparsity: float, progress: bool) -> list[float]:
    """OWL's first pass over the unpruned blocks: each block's share of outlier activations, turned
    into its own sparsity ratio averaging to `sparsity`."""
    scores, hidden = [], inputs
    for i, block in enumerate(tqdm(layers, desc="OWL outliers", disable=not progress)):
        linears, stats = collect_stats(block, hidden, kwargs[i], dtype, need_hessian=False)
        scores.append(outlier_ratio(linears, stats))
        hidden = run_block(block, hidden, kwargs[i], dtype)
    return owl_ratios(scores, sparsity)


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
    blocks: Blocks = IN_MEMORY,
    **settings,
) -> PruneReport:
    """Prune the Linear layers of `model`'s decoder blocks in place; return a report.

    `pattern` is None/"unstructured" (each layer at `sparsity`) or "N:M" ("2:4", "4:8"). Methods
    that need data take `calibration`, a LongTensor [n_samples, seqlen]. `owl=True` gives each
    block its own ratio from its share of outlier activations (OWL), averaging to `sparsity`.
    `calibration_dtype` is the autocast dtype of the calibration forwards: "auto" is bfloat16
    where the hardware computes it natively (see `fast_calibration_dtype`), None the model's dtype.
    `blocks` is where the block weights live (`scale.disk` streams them from and to shards).
    Further keywords are the pruner's settings (e.g. `mask_scope="row"` for SparseGPT), recorded in
    the report and so in the checkpoint.
    """
    shape = Pattern.parse(sparsity, pattern)
    require_float_linears(model, "prune")
    pruner = make_pruner(method, **settings)
    layers = decoder_layers(model)
    needs_data = pruner.needs_calibration or owl
    _check_data_and_owl(method, shape, needs_data, calibration, owl, blocks)
    n_samples, seqlen = calibration.shape if needs_data else (0, 0)
    report = PruneReport(method, str(shape), shape.sparsity, owl, n_samples, seqlen, settings=settings_of(pruner))
    started = time.perf_counter()
    ratios = [shape.sparsity] * len(layers)
    inputs, kwargs, dtype = (
        capture_inputs(model, share_of(calibration), batch, calibration_dtype, blocks.device)
        if needs_data
        else (None, None, None)
    )
    if owl:
        ratios = _owl_block_ratios(layers, inputs, kwargs, dtype, shape.sparsity, progress)
    block_counts: list[list[int]] = [[0, 0] for _ in layers]

    def prune_linear(i: int, name: str, linear: nn.Linear, stats: InputStats | None) -> None:
        pruned = pruner.prune_weight(linear.weight.data, Pattern(ratios[i], shape.n, shape.m), stats)
        linear.weight.data.copy_(pruned.to(linear.weight.dtype))

    def count_zeros(i: int, name: str, linear: nn.Linear, _: None) -> None:
        zero = int((linear.weight.data == 0).sum())
        report.layers[f"{i}.{name}"] = zero / linear.weight.numel()
        block_counts[i][0] += zero
        block_counts[i][1] += linear.weight.numel()

    desc = f"{method} {shape}"
    rewrite_layerwise(
        layers, prune_linear, count_zeros, inputs, kwargs, dtype, pruner.needs_hessian, desc, progress, blocks
    )
    report.block_sparsity = [zeros / total for zeros, total in block_counts]
    report.seconds = time.perf_counter() - started
    return report
