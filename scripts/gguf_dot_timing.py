"""Time the GGUF block kernel (`sparsegen::gguf_linear`) per format on the two models' shapes at 1, 8
and 128 input rows: microseconds a call, GB/s of blocks read, and GOP/s (2 x rows x out x in).
Random blocks (tests/test_gguf_blocks.py's generator); nothing else should run meanwhile.

Usage: python scripts/gguf_dot_timing.py [THREADS]
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


def seconds_per_call(call, repeats: int) -> float:
    for _ in range(10):
        call()
    started = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - started) / repeats


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    assert gguf_blocks.kernels_ready(), "the GGUF block kernels could not be built"
    print("| shape | format | rows | us a call | GB/s of blocks | GOP/s |\n|---|---|---|---|---|---|")
    for name, (out, inputs) in SHAPES.items():
        for format_name in FORMATS:
            qtype = GGMLQuantizationType[format_name]
            if inputs % 256 and format_name.endswith("_K"):
                continue
            blocks = torch.from_numpy(random_blocks(qtype, out, inputs))
            for rows in (1, 8, 128):
                x = torch.randn(rows, inputs)
                args = (x, blocks, int(qtype), inputs)
                s = seconds_per_call(lambda args=args: torch.ops.sparsegen.gguf_linear(*args), 50 if rows > 8 else 200)
                rate, gops = blocks.numel() / s / 1e9, 2 * rows * out * inputs / s / 1e9
                print(f"| {name} | {format_name} | {rows} | {s * 1e6:.0f} | {rate:.1f} | {gops:.1f} |")


if __name__ == "__main__":
    main()
