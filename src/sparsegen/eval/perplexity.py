"""Windowed perplexity by the standard pruning protocol: texts joined and tokenised once, split
into non-overlapping windows of `seqlen` (the remainder dropped), ppl = exp(mean NLL)."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
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
) -> PerplexityResult:
    """Perplexity of `input_ids` (1-D) over non-overlapping windows of `seqlen` tokens."""
    windows = input_ids.numel() // seqlen
    if max_windows is not None:
        windows = min(windows, max_windows)
    if windows == 0:
        raise SparsegenError(f"the text has {input_ids.numel()} tokens, fewer than one window of seqlen={seqlen}")
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
