"""`sparsegen bench contextual`: decode speed of contextual sparsity against the dense model, side by side.

Both run the project's fast decode path (`sparsegen.generate`) in the same mode, eager or compiled,
over the same prompt, alternating rounds so that drift of the machine hits both. Each row states
the bytes a step must read (the weights each selector reads, plus the held KV) and the fraction of
the measured memory bandwidth's bound it reaches.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from sparsegen.bench.measure import read_bandwidth_gbs
from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta

COLUMNS = [
    ("selector", "selector"),
    ("sparsity", "sparsity"),
    ("head_sparsity", "head sparsity"),
    ("batch", "batch"),
    ("kept", "neurons kept"),
    ("heads", "heads kept"),
    ("read", "layer weights read"),
    ("ms", "ms/token"),
    ("speedup", "vs dense"),
    ("mb", "MB read/step"),
    ("bound", "fraction of bound"),
]


def _decode_ms(model, prompt: torch.Tensor, tokens: int, compile: str, notify) -> float:
    """ms per greedy decode step after `prompt` [batch, n] on the fast path."""
    from sparsegen.decode import generate

    torch._dynamo.reset()  # a sparse model is another graph: compile it afresh (from the disk cache)
    return generate(model, prompt, tokens, compile=compile, eos_token_id=[], notify=notify).ms_per_step


def _step_bytes(model, prompt: torch.Tensor, context: int) -> tuple[float, float, float, float]:
    """The shares of MLP neurons and attention heads a decode step of the rows of `prompt` computes,
    the bytes it reads (the embedding table once, for the tied lm_head; the decoder layers' weights
    as their selectors read them; the KV), and the share of the decoder layers' weights read."""
    from sparsegen.contextual.apply import layer_kept_shares, read_bytes
    from sparsegen.models import decoder_layers

    size = next(model.parameters()).element_size()
    shares = layer_kept_shares(model, prompt)
    layer_read, layer_total = read_bytes(model, prompt, shares)
    outside = sum(p.numel() for p in model.parameters()) * size
    outside -= sum(p.numel() for layer in decoder_layers(model) for p in layer.parameters()) * size
    table = model.get_input_embeddings()
    if not getattr(model.config, "tie_word_embeddings", False) and isinstance(table, torch.nn.Embedding):
        outside -= table.weight.numel() * size  # a lookup reads one row (a GGUF table is no parameter)
    config = model.config
    kv = 2 * config.num_hidden_layers * config.num_key_value_heads * getattr(config, "head_dim", 64) * size
    step = outside + layer_read + kv * context * prompt.shape[0]
    return shares.mean_neurons, shares.mean_heads, step, layer_read / layer_total


def _switch_to(model, config: tuple[str, float, float], installed: dict, calibration, engine: str) -> None:
    """Make `model` run `config` (selector, sparsity, head sparsity): dense, or its selectors, fitted
    on `calibration` the first time and kept in `installed` for the later rounds to put back."""
    from sparsegen.contextual import densify, install, sparsify
    from sparsegen.contextual.apply import installed_heads

    selector, sparsity, heads = config
    densify(model)
    if selector == "dense":
        return
    if config not in installed:
        selectors = sparsify(model, selector, sparsity, calibration, head_sparsity=heads, progress=False, engine=engine)
        installed[config] = (selectors, installed_heads(model))
    else:
        install(model, *installed[config], engine)


def _rows(batches, configs: list, timings: dict, kept: dict, bandwidth: float) -> list[dict]:
    """The table: per batch and configuration its best round, against the dense model's best, and
    the share of the bandwidth's bound it reaches."""
    rows = []
    for batch in batches:
        dense_ms = min(timings[(configs[0], batch)])
        for config in configs:
            selector, sparsity, head_sparsity = config
            ms = min(timings[(config, batch)])
            share, heads, step_bytes, read = kept[config, batch]
            rows.append({
                "selector": selector, "sparsity": sparsity, "head_sparsity": head_sparsity, "batch": batch,
                "kept": share, "heads": heads, "read": read, "ms": ms,
                "speedup": dense_ms / ms, "mb": step_bytes / 1e6, "bound": step_bytes / (bandwidth * 1e9) / (ms / 1e3),
            })  # fmt: skip
    return rows


def _header(model_name: str, meta: dict, bandwidth: float) -> str:
    """The markdown table's opening line: the run's settings as `meta` records them, the measured
    read bandwidth (GB/s) and the machine."""
    compile, context, tokens, engine, rounds = (
        meta[key] for key in ("compile", "context", "tokens", "engine", "rounds")
    )
    return (
        f"model `{model_name}`, fp32, the fast decode path with compile={compile}, {context}-token prompt then "
        f"{tokens} greedy steps, sparse MLPs by the {engine} engine, mean ms per step, best of {rounds} alternating "
        f"rounds; read bandwidth "
        f"{bandwidth:.1f} GB/s; "
        f"{meta['machine']}, {meta['date']}\n\n"
    )


def bench_contextual(
    model_name: str = "smollm2-135m",
    selectors: tuple[str, ...] | None = None,
    sparsities: tuple[float, ...] = (0.5,),
    batches: tuple[int, ...] = (1,),
    context: int = 256,
    tokens: int = 32,
    rounds: int = 2,
    compile: str = "never",
    calib_text: str = "shakespeare",
    head_sparsities: tuple[float, ...] = (0.0,),
    out: Path = Path("results/bench_contextual"),
    progress: Callable[[str], None] = print,
    device: str | None = None,
    engine: str = "gather",
) -> list[dict]:
    """`engine`: how the sparse MLPs run a decode step on a CPU (`contextual.fused.ENGINES`)."""
    from sparsegen.contextual import densify
    from sparsegen.contextual.selector import faster_selectors
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.loading import load

    model, tokenizer = load(model_name, device=device)
    text = load_text(calib_text)
    calibration = calibration_samples(tokenizer, text, 8, 256, seed=0)
    bandwidth = read_bandwidth_gbs()
    selectors = tuple(faster_selectors()) if selectors is None else selectors
    configs = [("dense", 0.0, 0.0)] + [(s, p, h) for s in selectors for p in sparsities for h in head_sparsities]
    installed: dict = {}
    timings: dict = {}
    kept: dict = {}
    for batch in batches:
        prompt = calibration_samples(tokenizer, text, batch, context, seed=1)
        for round_ in range(rounds):
            for config in configs:
                selector, sparsity, heads = config
                progress(f"batch {batch}, round {round_ + 1}: {selector} {sparsity:.0%}, heads {heads:.0%}")
                _switch_to(model, config, installed, calibration, engine)
                ms = _decode_ms(model, prompt, tokens, compile, lambda message: progress(f"  {message}"))
                timings.setdefault((config, batch), []).append(ms)
                if (config, batch) not in kept:
                    kept[config, batch] = _step_bytes(model, prompt, context)
    densify(model)
    rows = _rows(batches, configs, timings, kept, bandwidth)
    meta = run_meta(
        model=model_name,
        engine=engine,
        context=context,
        tokens=tokens,
        rounds=rounds,
        compile=compile,
        bandwidth_gbs=round(bandwidth, 1),
    )
    write_json(out / "bench_contextual.json", {"meta": meta, "rows": rows})
    write_text(out / "bench_contextual.md", _header(model_name, meta, bandwidth) + markdown_table(rows, COLUMNS))
    return rows
