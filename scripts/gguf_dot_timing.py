"""Time the GGUF block kernels per format on the two models' shapes, in the file's order
(`sparsegen::gguf_linear`) and as panels (`gguf_panel_linear`, the formats a load repacks), at 1, 8,
128 and 2,048 input rows (a prompt read's GEMM): milliseconds a call, GB/s of blocks read, and GOP/s
(2 x rows x out x in); and each tensor decoded whole to bf16 ("bf16 decode": what a prompt's bf16 GEMM
multiplies where the CPU has AMX). Random blocks (tests/test_gguf_blocks.py's generator); nothing else
should run meanwhile. For an A/B of two checkouts run it with each one's `src` first on PYTHONPATH, in turn.

Usage: python scripts/gguf_dot_timing.py [THREADS] [ROWS,...]
"""

import sys
import time
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_gguf_blocks import random_blocks  # noqa: E402

from sparsegen.quant import gguf_blocks  # noqa: E402

SHAPES = {"smollm2 up": (1536, 576), "smollm2 down": (576, 1536), "qwen up": (8960, 1536), "qwen down": (1536, 8960)}
FORMATS = ("Q4_1", "Q4_K", "Q6_K", "Q8_0")


def seconds_per_call(call, budget_s: float = 1.0) -> float:
    """The median of as many calls as fit `budget_s` (at least 5), after two warm-up calls."""
    call(), call()
    times: list[float] = []
    while len(times) < 5 or sum(times) < budget_s:
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


DECODERS = {"file": "gguf_weight", "panels": "gguf_panel_weight"}  # the ops, once the kernels are loaded


def bf16_decode_row(name: str, format_name: str, order: str, held: torch.Tensor, inputs: int, rate_bytes: int) -> str:
    """A table row: the whole tensor `held` decoded to bf16 by `order`'s decoder."""
    qtype = int(GGMLQuantizationType[format_name])
    decode = getattr(torch.ops.sparsegen, DECODERS[order])
    s = seconds_per_call(lambda: decode(held, qtype, inputs, torch.bfloat16))
    return f"| {name} | {format_name} | {order} | bf16 decode | {s * 1e3:.3f} | {rate_bytes / s / 1e9:.1f} | - |"


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    row_counts = [int(n) for n in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1, 8, 128, 2048]
    assert gguf_blocks.kernels_ready(), "the GGUF block kernels could not be built"
    print("| shape | format | order | rows | ms a call | GB/s of blocks | GOP/s |\n|---|---|---|---|---|---|---|")
    for name, (out, inputs) in SHAPES.items():
        for format_name in FORMATS:
            qtype = GGMLQuantizationType[format_name]
            if inputs % 256 and format_name.endswith("_K"):
                continue
            blocks = torch.from_numpy(random_blocks(qtype, out, inputs))
            orders = {"file": (torch.ops.sparsegen.gguf_linear, blocks)}
            if qtype in gguf_blocks.PANEL_TYPES:
                panels = torch.ops.sparsegen.gguf_panels(blocks, int(qtype), inputs, False)
                orders["panels"] = (torch.ops.sparsegen.gguf_panel_linear, panels)
            for order, (op, held) in orders.items():
                print(bf16_decode_row(name, format_name, order, held, inputs, blocks.numel()))
                for rows in row_counts:
                    args = (torch.randn(rows, inputs), held, int(qtype), inputs)
                    s = seconds_per_call(lambda op=op, args=args: op(*args))
                    rate, gops = blocks.numel() / s / 1e9, 2 * rows * out * inputs / s / 1e9
                    print(f"| {name} | {format_name} | {order} | {rows} | {s * 1e3:.3f} | {rate:.1f} | {gops:.1f} |")


if __name__ == "__main__":
    main()
