"""A prompt read's attention: `sparsegen::span_attention` against torch's flash attention (sdpa,
causal) at the two models' head shapes, in bf16 and fp32, then packed prompt reads of the default model with
the kernel and with sdpa, in turn in one process (docs/benchmarks.md, "Prompt reads"); with
`--chunks`, a chunk's attention after held keys under transformers' bottom-right causal mask, and
long prompts read in chunks by both models in bf16, the kernel and sdpa in turn. Run it on a quiet
machine.

    python scripts/prompt_attention_time.py [--chunks]
"""

import sys
import time
from functools import partial

import torch
import torch.nn.functional as F

from sparsegen.decode.reading import read, read_packed
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


def masked_chunks() -> None:
    """A chunk of 512 queries after 512-7,680 held keys, bf16: the kernel against sdpa under the
    boolean mask transformers builds (both through `sdpa_or_span`, its check of the mask included)."""
    for name, (heads, kv_heads, dim) in SHAPES.items():
        module = type("Attention", (), {"is_causal": True, "num_key_value_groups": heads // kv_heads})()
        for keys in (1024, 2048, 4096, 8192):
            q = torch.randn(1, heads, 512, dim, dtype=torch.bfloat16)
            k, v = (torch.randn(1, kv_heads, keys, dim, dtype=torch.bfloat16) for _ in range(2))
            mask = torch.ones(1, 1, 512, keys, dtype=torch.bool).tril_(keys - 512)
            run = partial(prompt_attention.sdpa_or_span, module, q, k, v, mask)
            ours, theirs = in_turn(partial(quartile_s, run, 10))
            print(
                f"{name} 512 queries after {keys - 512} keys: span_attention {ours * 1e3:.2f} ms, "
                f"sdpa {theirs * 1e3:.2f} ms: {theirs / ours:.2f}x",
                flush=True,
            )


def in_turn(measure, rounds: int = 3) -> tuple[float, float]:
    """The middle of `rounds` calls of `measure()` with the kernel and with sdpa, alternating."""
    kernel = prompt_attention.load_float_rows
    times = {"kernel": [], "sdpa": []}
    for _ in range(rounds):
        for way in times:
            prompt_attention.load_float_rows = kernel if way == "kernel" else (lambda: None)
            times[way].append(measure())
    prompt_attention.load_float_rows = kernel
    return tuple(sorted(times[way])[rounds // 2] for way in times)


def chunked_read_s(model, ids: list[int]) -> float:
    started = time.perf_counter()
    read(model, ids, make_cache(model, "full"), chunk=512)
    return time.perf_counter() - started


def chunked_reads() -> None:
    """Prompts of 2,048 and 4,096 tokens read 512 at a time into a full cache, both models in bf16
    (the 1.5B's GGUF blocks with bf16 activations)."""
    generator = torch.Generator().manual_seed(0)
    for name in ("smollm2-135m", "qwen2.5-coder-1.5b"):
        model, _ = load(name, device="cpu", dtype=torch.bfloat16)
        with policy_attention(model):
            for length in (2048, 4096):
                ids = torch.randint(100, 30000, (length,), generator=generator).tolist()
                chunked_read_s(model, ids[:600])  # warm
                ours, theirs = in_turn(partial(chunked_read_s, model, ids))
                print(
                    f"{name} {length} tokens in chunks of 512: span_attention {ours:.2f} s, sdpa {theirs:.2f} s: "
                    f"{theirs / ours:.2f}x",
                    flush=True,
                )


if __name__ == "__main__":
    assert float_rows_op() is not None, "the float_rows kernels cannot be built here"
    torch.set_num_threads(2)
    if "--chunks" in sys.argv:
        masked_chunks()
        chunked_reads()
    else:
        kernels(torch.bfloat16)
        kernels(torch.float32)
        packed_reads()
