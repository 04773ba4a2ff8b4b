"""Quality of contextual sparsity against the dense model: perplexity, KL and top-1 agreement,
teacher-forced on a text the calibration did not use (every token takes the path decoding would)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.apply import KeptShares, densify, layer_kept_shares, read_bytes, sparsify


@torch.no_grad()
def quality_curve(
    model: nn.Module,
    ids: torch.Tensor,
    calibration: torch.Tensor,
    selectors: list[str],
    sparsities: list[float],
    seqlen: int = 512,
    windows: int = 8,
    dense_layers: int = 0,
    progress: Callable[[str], None] = lambda message: None,
    head_sparsity: float = 0.0,
) -> list[dict]:
    """One row per (selector, sparsity) plus the dense row: ppl, KL(dense || sparse), top-1 agreement,
    the share of MLP neurons and attention heads kept and of the layers' weights a decode step reads,
    over `windows` windows of `seqlen` tokens of `ids`; every row's attention runs at `head_sparsity`."""
    densify(model)
    chunks = [ids[w * seqlen : (w + 1) * seqlen][None] for w in range(min(windows, ids.numel() // seqlen))]
    dense = [model(chunk, use_cache=False).logits[0, :-1].float().log_softmax(-1) for chunk in chunks]
    reference = [(lp.half(), lp.argmax(-1)) for lp in dense]  # fp16 for the KL keeps 8 windows in 400 MB
    rows = [_row("dense", 0.0, dense, reference, chunks, KeptShares([1.0], [1.0]), 1.0)]
    del dense
    for selector in selectors:
        for sparsity in sparsities:
            progress(f"{selector} at {sparsity:.0%}")
            sparsify(model, selector, sparsity, calibration, dense_layers, progress=False, head_sparsity=head_sparsity)
            shares = layer_kept_shares(model, chunks[0])
            read, total = read_bytes(model, chunks[0], shares)
            logprobs = [model(chunk, use_cache=False).logits[0, :-1].float().log_softmax(-1) for chunk in chunks]
            rows.append(_row(selector, sparsity, logprobs, reference, chunks, shares, read / total))
            densify(model)
    return rows


def _row(selector, sparsity, logprobs, reference, chunks, shares: KeptShares, read) -> dict:
    nll = kl = agree = count = 0.0
    for lp, (ref, top1), chunk in zip(logprobs, reference, chunks, strict=True):
        nll -= lp.gather(1, chunk[0, 1:, None]).sum().item()
        kl += max(0.0, F.kl_div(lp, ref.float(), log_target=True, reduction="sum").item())
        agree += (lp.argmax(-1) == top1).sum().item()
        count += lp.shape[0]
    return {
        "selector": selector,
        "sparsity": sparsity,
        "kept": shares.mean_neurons,
        "heads": shares.mean_heads,
        "read": read,
        "ppl": math.exp(nll / count),
        "kl": kl / count,
        "top1": agree / count,
    }
