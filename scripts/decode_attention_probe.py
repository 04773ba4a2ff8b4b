"""What a fused decode-attention op could save (issue 40 (a)): one step's attention over 1,024 live
fp32 slots x 30 layers at SmolLM2's shapes (3 KV heads, 3 queries each, d = 64), as a C++ probe
(`decode_attention_probe.cpp`: scores, softmax and the value sum in one pass per (head, part of the
slots); AVX-512 only) against torch's SDPA and against `bmm` + softmax, each checked against the
same reference. Not a kernel of the package. Run it on a quiet machine.

    python scripts/decode_attention_probe.py
"""

import time
from pathlib import Path

import torch

from sparsegen.kernels.build import build

Q_HEADS, KV_HEADS, DIM, SLOTS, LIVE, LAYERS = 9, 3, 64, 1152, 1024, 30


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention of each query head over its KV head's live slots, in plain torch."""
    group = Q_HEADS // KV_HEADS
    keys, values = (t[:, :LIVE].repeat_interleave(group, 0) for t in (k, v))
    weights = torch.softmax(q[:, None] @ keys.transpose(1, 2) * DIM**-0.5, -1)
    return (weights @ values)[:, 0]


def best_ms(run, layers) -> float:
    best = float("inf")
    for _ in range(20):
        started = time.perf_counter()
        for q, k, v in layers:
            run(q, k, v)
        best = min(best, time.perf_counter() - started)
    return best * 1e3


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.set_num_threads(2)
    probe = build(Path(__file__).with_name("decode_attention_probe.cpp"), "the decode-attention probe")
    assert probe is not None, "the probe needs a compiler and AVX-512"
    layers = [
        (torch.randn(Q_HEADS, DIM), torch.randn(KV_HEADS, SLOTS, DIM), torch.randn(KV_HEADS, SLOTS, DIM))
        for _ in range(LAYERS)
    ]

    def fused(q, k, v):
        return probe.decode_attn(q, k, v, LIVE, DIM**-0.5, 2)

    def sdpa(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            q[None, :, None], k[None, :, :LIVE], v[None, :, :LIVE], enable_gqa=True
        )[0, :, 0]

    q, k, v = layers[0]
    for name, run in (("fused probe", fused), ("torch SDPA", sdpa), ("bmm + softmax", reference)):
        error = (run(q, k, v) - reference(q, k, v)).abs().max().item()
        print(f"{name:14s} {best_ms(run, layers):6.2f} ms for {LAYERS} layers (max |diff| {error:.1e})")
    kv_mb = LAYERS * 2 * KV_HEADS * LIVE * DIM * 4 / 1e6
    print(f"live KV read a step: {kv_mb:.1f} MB")
