"""Integer-dot int4 products against PyTorch's weight-only int4 kernel (docs/benchmarks.md,
"Integer-dot int4 products"): one layer per SmolLM2 shape at 1 and 2 threads, the model's tied
head in fp32 against its int8 integer-dot copy, then batch-1 decode after 1,024 tokens through the
compiled step, fp32 / int4 weight-only / int4 integer-dot, each twice, each in a process of its own.
Run it on a quiet machine, with an int4 checkpoint (`sparsegen quantize --bits 4 --out QDIR`).

    python scripts/int_dot_timing.py QDIR
"""

import sys
import time

import torch

from sparsegen.bench.decode import fast_decode_worker
from sparsegen.bench.measure import in_process
from sparsegen.quant import QuantScheme, make_quantizer
from sparsegen.quant.int_dot import Int8DotLinear, int_dot_linear
from sparsegen.quant.packed import pack_linear

SHAPES = ((1536, 576), (576, 1536), (576, 576), (192, 576))


def per_call_us(call, calls: int = 3000) -> float:
    with torch.inference_mode():
        for _ in range(100):
            call()
        started = time.perf_counter()
        for _ in range(calls):
            call()
    return (time.perf_counter() - started) / calls * 1e6


def layer_row(out_features: int, in_features: int) -> str:
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    scheme = QuantScheme(4, 96 if in_features == 576 else 128, False)
    grid = make_quantizer("rtn").quantize_weight(weight, scheme, None)
    groups = weight.unflatten(1, (-1, grid.group_size))
    integers = scheme.integers(groups, grid.scale[..., None], grid.zero_point[..., None]).flatten(1)
    layout = (integers.to(torch.int8), grid.scale.half(), grid.zero_point.to(torch.int8), 4)
    dots, weight_only = int_dot_linear(*layout), pack_linear(*layout)
    x = torch.randn(1, in_features)
    ours = per_call_us(lambda: torch.ops.sparsegen.int4_linear(x, dots.nibbles, dots.scales, dots.mins))
    theirs = per_call_us(
        lambda: torch._weight_int4pack_mm_for_cpu(
            x.bfloat16(), weight_only.packed, weight_only.group, weight_only.scale_and_offset
        )
    )
    return f"{out_features} x {in_features}: integer-dot {ours:.1f} us, weight-only {theirs:.1f} us"


def head_row() -> str:
    """The default model's tied head at one row: fp32 (as `F.linear`, and weight first as the
    eager few-row product) against its int8 copy on the integer-dot op."""
    from sparsegen.loading import load

    weight = load("smollm2-135m")[0].get_output_embeddings().weight.detach()
    head = Int8DotLinear.rounded(weight)
    x = torch.randn(1, weight.shape[1])
    linear = per_call_us(lambda: torch.nn.functional.linear(x, weight), 300)
    weight_first = per_call_us(lambda: weight @ x.T, 300)
    ours = per_call_us(lambda: torch.ops.sparsegen.int8_linear(x, head.codes, head.scales), 300)
    fp32 = f"fp32 F.linear {linear:.0f} us, fp32 W @ x.T {weight_first:.0f} us"
    return f"head {tuple(weight.shape)}: {fp32}, int8 integer-dot {ours:.0f} us"


def decode_rows(folder: str) -> None:
    """Each configuration in a process of its own (as `bench decode` runs it: a warm-up run, then
    64 measured tokens), so no compiled graph or model of another stays in memory beside it."""
    for name, activation_bits, label in (
        ("smollm2-135m", None, "fp32"),
        (folder, None, "int4 weight-only"),
        (folder, 8, "int4 integer-dot"),
    ):
        for run in range(2):
            args = (name, "shakespeare", 1024, 64, "fp32", "full", {}, 1, 2)
            result = in_process(fast_decode_worker, *args, activation_bits=activation_bits)
            print(f"{label}, process {run + 1}: {result['ms']:.1f} ms/token", flush=True)


if __name__ == "__main__":
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for shape in SHAPES:
            print(f"{threads} thread(s), {layer_row(*shape)}", flush=True)
    torch.set_num_threads(2)
    print(head_row(), flush=True)
    decode_rows(sys.argv[1])
