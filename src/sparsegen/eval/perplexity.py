"""Windowed perplexity by the standard pruning protocol: texts joined and tokenised once, split
into non-overlapping windows of `seqlen` (the remainder dropped), ppl = exp(mean NLL)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
from sparsegen.layerwise import blocks_skipped, capture_inputs, run_block
from sparsegen.layerwise_blocks import Blocks
from sparsegen.models import decoder_layers
from sparsegen.prompt.soft import SoftPrompt
from sparsegen.prompt.train import prompted_logits
from sparsegen.report import say_estimate


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    seqlen: int
    windows: int
    tokens: int

    def summary(self) -> dict:
        return asdict(self)


@torch.inference_mode()
def windowed_ppl(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    seqlen: int = 2048,
    max_windows: int | None = None,
    progress: bool = True,
    blocks: Blocks | None = None,
) -> PerplexityResult:
    """Perplexity of `input_ids` (1-D) over non-overlapping windows of `seqlen` tokens.

    With `blocks` (`scale.disk`), the windows go through the model one decoder block at a time,
    all windows a block, so only one block's weights are held; the result is the same.
    """
    windows = input_ids.numel() // seqlen
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise SparsegenError(f"the text has {input_ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
    if blocks is not None:
        nll = _layerwise_nll(model, input_ids[: windows * seqlen].view(windows, seqlen), blocks, progress)
        return PerplexityResult(math.exp(nll), nll, seqlen, windows, windows * seqlen)
    device = next(model.parameters()).device
    total = 0.0
    started = time.perf_counter()
    for w in tqdm(range(windows), desc=f"perplexity @ {seqlen}", unit="window", disable=not progress):
        window = input_ids[w * seqlen : (w + 1) * seqlen].to(device)[None]
        logits = model(window, use_cache=False).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
        if w == 0 and progress and windows > 1:
            say_estimate(time.perf_counter() - started, windows, "window", "--max-windows for fewer")
    nll = total / (windows * (seqlen - 1))
    return PerplexityResult(math.exp(nll), nll, seqlen, windows, windows * seqlen)


def _layerwise_nll(model: torch.nn.Module, windows: torch.Tensor, blocks: Blocks, progress: bool) -> float:
    """Mean NLL of the windows [count, seqlen], computed block after block over all of them."""
    layers = decoder_layers(model)
    hidden, kwargs, _ = capture_inputs(model, windows, batch=1, calibration_dtype=None)
    for i, block in enumerate(
        tqdm(layers, desc=f"perplexity @ {windows.shape[1]}", unit="block", disable=not progress)
    ):
        with blocks.held(i, block):
            outputs = run_block(block, hidden, kwargs[i], None)
        hidden.close()
        hidden = outputs
    total, last = 0.0, len(layers) - 1
    for window, final in zip(windows, hidden, strict=True):
        with blocks_skipped(layers, lambda index, x, final=final: final if index == last else x):
            logits = model(window[None], use_cache=False).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
    return total / (windows.numel() - windows.shape[0])


@torch.no_grad()
def prompted_ppl(
    model: torch.nn.Module,
    prompt: SoftPrompt | None,
    input_ids: torch.Tensor,
    seqlen: int,
    max_windows: int | None = None,
) -> PerplexityResult:
    """Windowed perplexity with the soft prompt before every window, over the same tokens as
    `windowed_ppl` (all but each window's first), so the two compare; without a prompt it is that."""
    windows = input_ids.numel() // seqlen
    windows = min(windows, max_windows) if max_windows is not None else windows
    if windows == 0:
        raise SparsegenError(f"the text has {input_ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
    total = scored = 0
    for w in range(windows):
        window = input_ids[w * seqlen : (w + 1) * seqlen][None]
        logits = prompted_logits(model, prompt, window).float()[:, -(seqlen - 1) :]
        targets = window[:, 1:]
        total += F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        scored += targets.numel()
    nll = total / scored
    return PerplexityResult(math.exp(nll), nll, seqlen, windows, windows * seqlen)
