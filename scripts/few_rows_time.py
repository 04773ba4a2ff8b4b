"""The few-row fp32 products (`few_rows.float_rows_op`) against torch's, and eager decoding with
them, for an A/B against another commit run through `PYTHONPATH=<its src>` (docs/benchmarks.md,
"the server's batched step"); with `--bf16`, the bf16 panels against oneDNN's bf16 GEMM from 1 to 64
rows, and the kernel's GEMM past its limit (weight first, as rows: where they cross sets
`few_rows.AMX_PANEL_ROWS` and the kernel's `kWeightFirstRows`). Run it on a quiet machine.

    python scripts/few_rows_time.py            # products of this checkout, then eager generate()
    PYTHONPATH=<old checkout>/src python scripts/few_rows_time.py --generate-only
    python scripts/few_rows_time.py --bf16 --products-only
"""

import sys
import time

import torch

import sparsegen
from sparsegen.data import text_stretches
from sparsegen.loading import load

torch.set_num_threads(2)
# SmolLM2-135M's layer shapes (q, o, k, v, gate, up, down) x 30 layers: 424 MB of fp32 weights
SHAPES = [(576, 576)] * 2 + [(192, 576)] * 2 + [(1536, 576)] * 2 + [(576, 1536)]


def best_ms(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times) * 1000


def products(dtype: torch.dtype) -> None:
    from sparsegen.few_rows import float_rows_op

    op = float_rows_op()
    layers = [[torch.randn(o, i).to(dtype) for o, i in SHAPES] for _ in range(30)]
    packed = {id(w): torch.ops.sparsegen.float_rows_pack(w) for layer in layers for w in layer}
    megabytes = sum(o * i for o, i in SHAPES) * 30 * dtype.itemsize / 1e6
    for rows in (1, 2, 4, 8, 16) if dtype == torch.float32 else (1, 2, 3, 4, 8, 16, 20, 24, 32, 64):
        inputs = {size: torch.randn(rows, size).to(dtype) for size in (576, 1536)}
        ways = {
            "F.linear": torch.nn.functional.linear,
            "weight @ x.T": lambda x, w: w @ x.T,
            "float_rows_linear": lambda x, w: op(x, packed[id(w)], w.shape[0]),
        }
        if dtype == torch.bfloat16:  # the kernel's GEMM past its limit: weight first, laid out as rows
            ways["weight first as rows"] = lambda x, w: op(x, packed[id(w)], w.shape[0], w, 0)
        cells = []
        for name, product in ways.items():
            ms = best_ms(lambda p=product, x=inputs: [p(x[w.shape[1]], w) for layer in layers for w in layer])
            cells.append(f"{name} {ms:.1f} ms ({megabytes / ms:.1f} GB/s)")
        print(f"{rows:2d} rows, 30 layers: " + ", ".join(cells), flush=True)


def eager_generate() -> None:
    model, tokenizer = load("smollm2-135m", device="cpu")
    ids = text_stretches(tokenizer, "shakespeare", 1, 1024)[0]
    for rows in (1, 4):
        prompts = [ids[i * 200 : (i + 1) * 200] for i in range(rows)]
        run = lambda p=prompts: sparsegen.generate(model, p, 64, compile="never", eos_token_id=[])  # noqa: E731
        print(f"eager generate(), {rows} x 200-token prompt + 64 tokens: {best_ms(run, 3) / 1000:.2f} s", flush=True)


if __name__ == "__main__":
    if "--generate-only" not in sys.argv:
        products(torch.bfloat16 if "--bf16" in sys.argv else torch.float32)
    if "--products-only" not in sys.argv:
        eager_generate()
