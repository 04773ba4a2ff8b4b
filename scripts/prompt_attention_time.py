"""A prompt read's attention: `sparsegen::span_attention` against torch's flash attention (sdpa,
causal) at the two models' head shapes, in bf16 and fp32, then packed prompt reads of the default model with
the kernel and with sdpa, in turn in one process (docs/benchmarks.md, "Prompt reads"). Run it on
a quiet machine.

    python scripts/prompt_attention_time.py
"""

import time
from functools import partial

import torch
import torch.nn.functional as F

from sparsegen.decode.reading import read_packed
from sparsegen.few_rows import float_rows_op, pack_weights, use_gemv
from sparsegen.kv import make_cache, prompt_attention
from sparsegen.kv.attention import policy_attention
from sparsegen.loading import load

# (heads, kv heads, head size): SmolLM2-135M, Qwen2.5-Coder-1.5B
SHAPES = {"smollm2-135m": (9, 3, 64), "qwen2.5-1.5b": (12, 2, 128)}


def quartile_s(run, repeats: int = 20) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return sorted(times)[repeats // 4]


def kernels(dtype: torch.dtype) -> None:
    op = torch.ops.sparsegen.span_attention
    for name, (heads, kv_heads, dim) in SHAPES.items():
        for length in (48, 128, 256, 384, 512, 1024, 2048, 4096):
            q, k, v = (torch.randn(1, h, length, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
            flash = quartile_s(partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True))
            ours = quartile_s(partial(op, q[0], k[0], v[0], dim**-0.5))
            macs = heads * length * (length + 1) / 2 * dim * 2  # the causal half: scores and values
            print(
                f"{dtype} {name} {length:5d} tokens: flash {flash * 1e6:8.0f} us ({macs / flash / 1e9:5.1f} GMAC/s), "
                f"span_attention {ours * 1e6:8.0f} us ({macs / ours / 1e9:5.1f} GMAC/s): {flash / ours:.2f}x",
                flush=True,
            )


def packed_reads() -> None:
    model, _ = load("smollm2-135m", device="cpu")
    use_gemv(model, rows_vary=True, packed=pack_weights(model))  # as the server's engine runs
    generator = torch.Generator().manual_seed(0)
    kernel = prompt_attention.load_float_rows
    with policy_attention(model):
        for lengths in ((128,), (384,), (256, 256), (384, 128), (48, 128, 256)):
            prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in lengths]
            times = {"span_attention": [], "sdpa": []}
            for _ in range(6):
                for way in times:
                    prompt_attention.load_float_rows = kernel if way == "span_attention" else (lambda: None)
                    read = lambda p=prompts: read_packed(model, p, [make_cache(model, "full") for _ in p])  # noqa: E731
                    times[way].append(quartile_s(read, 2))
            ours, theirs = (sorted(times[way])[2] for way in times)
            print(
                f"packed read of {'+'.join(map(str, lengths))} tokens: span_attention {ours * 1e3:.1f} ms, "
                f"sdpa {theirs * 1e3:.1f} ms: {theirs / ours:.3f}x",
                flush=True,
            )
    prompt_attention.load_float_rows = kernel


if __name__ == "__main__":
    assert float_rows_op() is not None, "the float_rows kernels cannot be built here"
    torch.set_num_threads(2)
    kernels(torch.bfloat16)
    kernels(torch.float32)
    packed_reads()
