"""`sparsegen bench contextual`: decode speed of sparse MLPs against the dense model, side by side.

Both run the same eager path (transformers' modules; only the MLPs differ) over the same prompt and
cache length, alternating rounds so that drift of the machine hits both. Each row states the bytes
a step must read (weights, with the MLP's share cut to what the selector reads, plus the held KV)
and the fraction of the measured memory bandwidth's bound it reaches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache

from sparsegen.bench.measure import read_bandwidth_gbs, run_meta
from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table

COLUMNS = [
    ("selector", "selector"),
    ("sparsity", "sparsity"),
    ("batch", "batch"),
    ("kept", "neurons kept"),
    ("ms", "ms/token"),
    ("speedup", "vs dense"),
    ("mb", "MB read/step"),
    ("bound", "fraction of bound"),
]


@torch.no_grad()
def _decode_ms(model, prompt: torch.Tensor, tokens: int) -> float:
    """Median ms of one greedy decode step after `prompt` [batch, n]."""
    cache = DynamicCache(config=model.config)
    logits = model(prompt, past_key_values=cache, use_cache=True).logits[:, -1:]
    times = []
    for _ in range(tokens):
        step = logits.argmax(-1)
        started = time.perf_counter()
        logits = model(step, past_key_values=cache, use_cache=True).logits
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _step_bytes(model, selector, kept: float, batch: int, context: int) -> float:
    """Bytes one decode step reads: every weight, MLP rows only where kept, plus the KV cache
    (`model` with its dense MLPs in place)."""
    from sparsegen.contextual import SELECTORS, mlp_parts
    from sparsegen.prune.pipeline import decoder_layers

    size = next(model.parameters()).element_size()
    total = sum(p.numel() for p in model.parameters()) * size
    if getattr(model.config, "tie_word_embeddings", False):
        total += model.get_input_embeddings().weight.numel() * size  # the lm_head reads the table again
    total -= model.get_input_embeddings().weight.numel() * size  # a lookup reads one row
    if selector != "dense":
        parts = mlp_parts(decoder_layers(model)[0].mlp)
        linears = [linear for linear in (parts.gate, parts.up, parts.down) if linear is not None]
        per_layer = sum(linear.weight.numel() for linear in linears) * size
        gate = parts.gate.weight.numel() * size if SELECTORS[selector].needs_gate and parts.gate is not None else 0
        total -= len(decoder_layers(model)) * (per_layer - gate) * (1 - kept)
    config = model.config
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * getattr(config, "head_dim", 64) * size
    return total + kv * context * batch


def bench_contextual(
    model_name: str = "smollm2-135m",
    selectors: tuple[str, ...] = ("threshold", "static"),
    sparsities: tuple[float, ...] = (0.5,),
    batches: tuple[int, ...] = (1,),
    context: int = 256,
    tokens: int = 32,
    rounds: int = 2,
    calib_text: str = "shakespeare",
    out: Path = Path("results/bench_contextual"),
    progress: Callable[[str], None] = print,
) -> list[dict]:
    from sparsegen.contextual import densify, install, sparsify
    from sparsegen.contextual.apply import kept_share
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.models import load

    model, tokenizer = load(model_name)
    text = load_text(calib_text)
    calibration = calibration_samples(tokenizer, text, 8, 256, seed=0)
    bandwidth = read_bandwidth_gbs()
    configs = [("dense", 0.0)] + [(s, p) for s in selectors for p in sparsities]
    installed: dict = {}
    timings: dict = {}
    kept: dict = {}
    for batch in batches:
        prompt = calibration_samples(tokenizer, text, batch, context, seed=1)
        for round_ in range(rounds):
            for config in configs:
                selector, sparsity = config
                progress(f"batch {batch}, round {round_ + 1}: {selector} {sparsity:.0%}")
                densify(model)
                if selector != "dense":
                    if config not in installed:
                        installed[config] = sparsify(model, selector, sparsity, calibration, progress=False)
                        kept[config] = kept_share(model, prompt[:1])
                    else:
                        install(model, installed[config])
                timings.setdefault((config, batch), []).append(_decode_ms(model, prompt, tokens))
    densify(model)
    rows = []
    for batch in batches:
        dense_ms = min(timings[(("dense", 0.0), batch)])
        for config in configs:
            selector, sparsity = config
            ms = min(timings[(config, batch)])
            share = kept.get(config, 1.0)
            step_bytes = _step_bytes(model, selector, share, batch, context)
            rows.append({
                "selector": selector, "sparsity": sparsity, "batch": batch, "kept": share, "ms": ms,
                "speedup": dense_ms / ms, "mb": step_bytes / 1e6, "bound": step_bytes / (bandwidth * 1e9) / (ms / 1e3),
            })  # fmt: skip
    meta = run_meta(model=model_name, context=context, tokens=tokens, rounds=rounds, bandwidth_gbs=round(bandwidth, 1))
    write_json(out / "bench_contextual.json", {"meta": meta, "rows": rows})
    header = (
        f"model `{model_name}`, fp32 eager, {context}-token prompt then greedy decoding, median ms per step over "
        f"{tokens} steps, best of {rounds} alternating rounds; read bandwidth {bandwidth:.1f} GB/s; "
        f"{meta['machine']}, {meta['date']}\n\n"
    )
    write_text(out / "bench_contextual.md", header + markdown_table(rows, COLUMNS))
    return rows
