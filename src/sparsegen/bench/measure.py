"""The harnesses' measuring tools: per-token decode latency inside generate(), the bytes a step reads
of the weights, the machine's read bandwidth, a run in a fresh process. Resident memory is
`sparsegen.rss` (the server reads it too)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import LogitsProcessor


class TokenClock(LogitsProcessor):
    """Timestamps every generation step; the gaps are the per-token decode latency of generate()."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores

    def decode_ms(self) -> float:
        """Median milliseconds per decoded token (the first step, the prefill, is excluded)."""
        gaps = [b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)]
        return statistics.median(gaps) * 1000 if gaps else float("nan")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a step reads of the weights: the memory under the parameters and packed layers' buffers once
    (tied embeddings once), as stored: a packed layer counts its integers, scales and offsets. An
    input embedding that is not also the output head is left out (a step reads one row of it)."""
    from sparsegen.quant.gguf_blocks import GGUFEmbedding
    from sparsegen.quant.linear import PackedLinear

    packed = [b for m in model.modules() if isinstance(m, PackedLinear) for b in m.buffers(recurse=False)]
    spans = {(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in [*model.parameters(), *packed]}
    lookup = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    embedding = None if lookup is None or isinstance(lookup, GGUFEmbedding) else lookup.weight  # blocks: not counted
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if embedding is not None and getattr(head, "weight", None) is not embedding:
        spans.discard((embedding.data_ptr(), embedding.data_ptr() + embedding.numel() * embedding.element_size()))
    return _covered(spans)


def _covered(spans: set[tuple[int, int]]) -> int:
    """Bytes covered by the address ranges [start, end): a view inside another tensor (a joined
    layer's rows) counts once."""
    total, reached = 0, 0
    for start, end in sorted(spans):
        total += max(0, end - max(start, reached))
        reached = max(reached, end)
    return total


def in_process(fn, *args, **kwargs):
    """Run `fn(*args, **kwargs)` in a fresh spawned process: its peak RSS and warm caches are its own."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args, kwargs)


def read_bandwidth_gbs(megabytes: int = 256, repeats: int = 5, device: str | torch.device = "cpu") -> float:
    """Memory read bandwidth of this machine (or of a GPU's memory) in GB/s: the best of `repeats`
    sums over a tensor far larger than the caches (the bound a memory-bound decode step is
    measured against)."""
    import time

    data = torch.ones(megabytes * 2**20 // 4, device=device)
    settle = torch.cuda.synchronize if data.is_cuda else lambda: None
    data.sum()
    settle()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        settle()
        best = min(best, time.perf_counter() - started)
    return data.numel() * 4 / best / 1e9
