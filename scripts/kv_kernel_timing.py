"""One decode step's attention products over 8,192 held tokens x 30 layers (SmolLM2's 3 KV heads,
3 queries each, d = 64): fp32 `q @ K^T` and `p @ V` against the int4 kernels of `kv/kernels.py`
(docs/benchmarks.md, "Decode speed and bytes"). Run it on a quiet machine.

    python scripts/kv_kernel_timing.py
"""

import time

import torch

from sparsegen.kv.kernels import held_mix, held_scores, kernels_available
from sparsegen.kv.quantized import RING_SLOTS, KVCodec

TOKENS, HEADS, QUERIES, DIM, LAYERS = 8192, 3, 3, 64, 30


def per_step_ms(step) -> float:
    for _ in range(2):
        step()
    started = time.perf_counter()
    for _ in range(5):
        step()
    return (time.perf_counter() - started) / 5 * 1e3


if __name__ == "__main__":
    torch.manual_seed(0)
    assert kernels_available(), "the kernels could not be built on this machine"
    codec = KVCodec.for_dim(4, DIM)
    keys = [torch.randn(1, HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    values = [torch.randn(1, HEADS, TOKENS, DIM) for _ in range(LAYERS)]
    key_rows, value_rows = [codec.encode(k) for k in keys], [codec.encode(v) for v in values]
    query, probs = torch.randn(1, HEADS, QUERIES, DIM), torch.rand(1, HEADS, QUERIES, TOKENS)
    positions, seen = torch.arange(TOKENS).expand(1, HEADS, TOKENS).contiguous(), torch.tensor([TOKENS])
    ring = torch.randn(1, HEADS, RING_SLOTS, DIM)
    with torch.inference_mode():
        fp32 = per_step_ms(
            lambda: [(query @ k.transpose(-1, -2), probs @ v) for k, v in zip(keys, values, strict=True)]
        )
        scores = per_step_ms(lambda: [held_scores(query, k, codec, positions, seen, ring) for k in key_rows])
        mixed = per_step_ms(lambda: [held_mix(probs, v, codec, positions, seen, ring) for v in value_rows])
    print(
        f"fp32 products {fp32:.1f} ms; int4 kernels {scores + mixed:.1f} ms (scores {scores:.1f}, values {mixed:.1f})"
    )
