"""`sparsegen bench prune`: pruning time per method, and decode speed per sparsity pattern.

Every configuration is measured in the same run as its dense baseline. 2:4 semi-structured kernels
need a CUDA GPU (`torch.sparse.to_sparse_semi_structured`); on a CPU they are reported as not run.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta

TIME_COLUMNS = [("method", "method"), ("pattern", "pattern"), ("seconds", "pruning s"), ("vs_wanda", "x Wanda time")]
SPEED_COLUMNS = [
    ("sparsity", "sparsity"),
    ("index", "CSR indices"),
    ("layers_csr", "layers swapped to CSR"),
    ("dense_tok_s", "dense tok/s"),
    ("sparse_tok_s", "accelerated tok/s"),
    ("speedup", "speedup"),
]
GEMV_COLUMNS = [
    ("sparsity", "sparsity"),
    ("dense_us", "dense"),
    ("csr32_us", "CSR int32"),
    ("csr64_us", "CSR int64"),
    ("csr32_speedup", "dense / CSR int32"),
]


def _decode_tok_s(model, ids: torch.Tensor, tokens: int) -> float:
    from transformers import DynamicCache

    with torch.inference_mode():
        cache = DynamicCache()
        logits = model(ids, cache=cache).logits
        start = time.perf_counter()
        for _ in range(tokens):
            logits = model(logits[:, -1:].argmax(-1), cache=cache).logits
    return tokens / (time.perf_counter() - start)


def _timing_rows(model_name: str, device: str | None, calibration: torch.Tensor, progress) -> list[dict]:
    """Pruning time of every method to 50% unstructured, and of the calibrated ones to 2:4, each on a
    fresh model, against Wanda's time on the same pattern."""
    from sparsegen.loading import load
    from sparsegen.prune import PRUNERS, prune

    timing = []
    calibrated = [m for m in sorted(PRUNERS) if PRUNERS[m].needs_calibration]
    for method, pattern in [(m, None) for m in sorted(PRUNERS)] + [(m, "2:4") for m in calibrated]:
        progress(f"pruning time: {method} {pattern or 'unstructured'}")
        model, _ = load(model_name, packed=False, device=device)  # pruned: fp32 on a CPU
        report = prune(model, method, 0.5, pattern, calibration=calibration, progress=False)
        timing.append({"method": method, "pattern": report.pattern, "seconds": report.seconds})
    wanda = {row["pattern"]: row["seconds"] for row in timing if row["method"] == "wanda"}
    for row in timing:
        row["vs_wanda"] = row["seconds"] / wanda[row["pattern"]] if row["pattern"] in wanda else None
    return timing


def _speed_row(model_name: str, device: str | None, sparsity: float, prompt: torch.Tensor, tokens: int) -> dict:
    """Decode speed of a fresh model magnitude-pruned to `sparsity`, dense and with its Linear layers
    swapped to CSR where that pays (`accelerate`)."""
    from sparsegen.loading import load
    from sparsegen.prune import prune
    from sparsegen.prune.accelerate import CSRLinear, accelerate

    model, _ = load(model_name, packed=False, device=device)
    prune(model, "magnitude", sparsity, progress=False)
    dense_tok_s = _decode_tok_s(model, prompt, tokens)
    ratios = accelerate(model)
    swapped = sum(isinstance(m, CSRLinear) for m in model.modules())
    sparse_tok_s = _decode_tok_s(model, prompt, tokens)
    return {
        "sparsity": sparsity,
        "index": "int32",
        "layers_csr": f"{swapped}/{len(ratios)}",
        "dense_tok_s": dense_tok_s,
        "sparse_tok_s": sparse_tok_s,
        "speedup": sparse_tok_s / dense_tok_s,
    }


def bench_prune(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    n_samples: int = 16,
    seqlen: int = 512,
    sparsities: tuple[float, ...] = (0.5, 0.7, 0.9),
    decode_tokens: int = 32,
    out: Path = Path("results/bench_prune"),
    progress=print,
    gemv_shape: tuple[int, int] = (1536, 576),
    device: str | None = None,
) -> dict:
    from sparsegen.data import calibration_samples, load_text, tokenize_long
    from sparsegen.loading import load

    model, tokenizer = load(model_name, packed=False, device=device)
    corpus = load_text(text)
    calibration = calibration_samples(tokenizer, corpus, n_samples, seqlen)
    timing = _timing_rows(model_name, device, calibration, progress)

    prompt = tokenize_long(tokenizer, corpus, max_tokens=64)[None]
    speed = []
    for sparsity in sparsities:
        progress(f"decode speed at {sparsity:.0%} (magnitude-pruned; speed does not depend on the method)")
        speed.append(_speed_row(model_name, device, sparsity, prompt, decode_tokens))
    gemv = _gemv_table(sparsities, *gemv_shape)
    gpu = "not run: needs a CUDA GPU" if not torch.cuda.is_available() else "not implemented yet"
    meta = run_meta(model=model_name, text=text, n_samples=n_samples, seqlen=seqlen, semi_structured_2_4=gpu)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_prune.json", {"meta": meta, "timing": timing, "speed": speed, "gemv": gemv})
    write_text(
        out / "bench_prune.md",
        "".join(
            [
                f"model `{model_name}`, calibration {n_samples} x {seqlen} tokens of `{text}`, {meta['machine']}, "
                f"{meta['date']}\n\n",
                markdown_table(timing, TIME_COLUMNS),
                "\n",
                markdown_table(speed, SPEED_COLUMNS),
                f"\nbatch-1 GEMV of a {gemv_shape[0]} x {gemv_shape[1]} weight, microseconds:\n\n",
                markdown_table(gemv, GEMV_COLUMNS),
                f"\n2:4 semi-structured: {meta['semi_structured_2_4']}\n",
            ]
        ),
    )
    return {"meta": meta, "timing": timing, "speed": speed, "gemv": gemv}


def _gemv_table(sparsities, rows: int = 1536, cols: int = 576, copies: int = 64, repeats: int = 20) -> list[dict]:
    """Batch-1 GEMV timings over `copies` distinct matrices (a working set larger than the caches)."""
    from sparsegen.prune.accelerate import to_csr

    generator = torch.Generator().manual_seed(0)
    table = []
    x = torch.randn(1, cols)

    def timed(weights):
        start = time.perf_counter()
        for _ in range(repeats):
            for w in weights:
                torch.nn.functional.linear(x, w)
        return (time.perf_counter() - start) / (repeats * len(weights)) * 1e6

    for sparsity in sparsities:
        dense = []
        for _ in range(copies):
            w = torch.randn(rows, cols, generator=generator)
            dense.append(w.masked_fill(torch.rand(rows, cols, generator=generator) < sparsity, 0))
        d = timed(dense)
        c32 = timed([to_csr(w, torch.int32) for w in dense])
        c64 = timed([to_csr(w, torch.int64) for w in dense])
        table.append({"sparsity": sparsity, "dense_us": d, "csr32_us": c32, "csr64_us": c64, "csr32_speedup": d / c32})
    return table
