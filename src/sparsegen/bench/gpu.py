"""`sparsegen bench gpu`: the seeds' GPU claims on real shapes, measured in one run.

No checkpoint reaches a GPU machine without a hub, so the model is built from a config (Llama-3-8B
or Llama-3.2-1B shapes) with random weights: every timing is that of the real shape; only
contextual sparsity's masks depend on the weights, and its thresholds are calibrated to keep the
stated share. Each table states this. Measured side by side, against the memory bandwidth probed
in the same run: dense decode (eager and compiled), streaming and h2o against dense at a long
context, throughput in a fixed KV memory, TEAL and neuron sparsity at batch 1 and 4, 2:4 against
dense, and pruning time per layer. On a CPU the same code runs (`--shape tiny` in the tests).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from sparsegen.bench.measure import read_bandwidth_gbs, weight_bytes
from sparsegen.contextual import densify, sparsify
from sparsegen.decode import generate
from sparsegen.ioutil import write_json, write_text
from sparsegen.kernels import Unpacked
from sparsegen.kv.footprint import kv_bytes_per_token
from sparsegen.kv.spec import KVSpec
from sparsegen.models import default_dtype, pick_device
from sparsegen.prune import prune
from sparsegen.prune.accelerate import SemiStructuredLinear, sparse_form
from sparsegen.prune.pruner import Pattern, mask_lowest
from sparsegen.random_model import llama_config
from sparsegen.report import markdown_table, run_meta

COLUMNS = [("what", "what"), ("setting", "setting"), ("batch", "batch"), ("tokens_per_s", "tokens/s"),
           ("ms", "ms/step"), ("gbs", "GB/s"), ("bound", "share of bandwidth"), ("vs_dense", "vs dense"),
           ("note", "note")]  # fmt: skip


def random_llama(shape: str, device: torch.device, dtype: torch.dtype, layers: int | None = None) -> LlamaForCausalLM:
    """A Llama of `shape` with random weights, built directly on `device` (`layers` overrides the depth)."""
    config = llama_config(shape, 32000)  # Llama-2's vocabulary, unless the shape names its own
    config.max_position_embeddings = 131072
    if layers is not None:
        config.num_hidden_layers = layers
    with torch.device(device):
        return LlamaForCausalLM._from_config(config, dtype=dtype).eval()


def step_bytes(model: torch.nn.Module, rows: int, held_tokens: int, kv_dtype: torch.dtype) -> int:
    """Bytes one decode step reads: every weight but the input embedding table (a row per token
    is gathered; tied to the head, it is read whole) and every row's held keys and values."""
    embedding = model.get_input_embeddings().weight
    tied = embedding is model.get_output_embeddings().weight
    weights = weight_bytes(model) - (0 if tied else embedding.numel() * embedding.element_size())
    return weights + rows * held_tokens * kv_bytes_per_token(model, kv_dtype)


def _prompts(model, rows: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(10, model.config.vocab_size, (rows, length), generator=generator).tolist()


def _kv_dtype(model) -> torch.dtype:
    """The dtype `generate` keeps keys and values in: the weights' on an accelerator, fp32 on a CPU."""
    return next(model.parameters()).dtype if model.device.type != "cpu" else torch.float32


def _decode_row(
    model,
    what,
    setting,
    rows,
    context,
    new_tokens,
    bandwidth,
    compile="always",
    held=None,
    kv="full",
    prefill_chunk=None,
):
    """Tokens/s of `new_tokens` greedy steps after `context` random prompt tokens per row (the
    compiler starts afresh: every row's step is compiled for its own shapes, once)."""
    torch._dynamo.reset()
    out = generate(model, _prompts(model, rows, context), new_tokens, kv, compile=compile, eos_token_id=[],
                   notify=lambda message: None, prefill_chunk=prefill_chunk)  # fmt: skip
    moved = step_bytes(model, rows, held if held is not None else context + new_tokens // 2, _kv_dtype(model))
    gbs = moved / (out.ms_per_step / 1000) / 1e9
    return {"what": what, "setting": setting, "batch": rows, "tokens_per_s": round(out.tokens_per_s, 1),
            "ms": round(out.ms_per_step, 3), "gbs": round(gbs, 1), "bound": f"{gbs / bandwidth:.0%}",
            "note": out.mode}  # fmt: skip


def _versus(rows: list[dict], dense: dict) -> list[dict]:
    for row in rows:
        row["vs_dense"] = f"{row['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
    return rows


def _semi_structured(device: torch.device, dtype: torch.dtype, out_features: int, in_features: int) -> list[dict]:
    """One MLP-shaped Linear pruned 2:4, dense against its semi-structured form, at 1, 4 and 16 rows."""
    linear = torch.nn.Linear(in_features, out_features, bias=False, device=device, dtype=dtype)
    with torch.no_grad():
        linear.weight.masked_fill_(mask_lowest(linear.weight.abs(), Pattern.parse(0.5, "2:4"), per_row=True), 0)
    sparse = sparse_form(linear)
    if not isinstance(sparse, SemiStructuredLinear):
        why = sparse.reason if isinstance(sparse, Unpacked) else "semi-structured sparse tensors need a CUDA GPU"
        return [{"what": "2:4 matmul", "setting": f"{out_features}x{in_features}", "note": f"not run here: {why}"}]
    rows = []
    for batch in (1, 4, 16):
        x = torch.randn(batch, in_features, device=device, dtype=dtype)
        times = {name: _time(lambda m=m, x=x: m(x)) for name, m in (("dense", linear), ("2:4", sparse))}
        rows.append({"what": "2:4 matmul", "setting": f"{out_features}x{in_features}", "batch": batch,
                     "ms": round(times["2:4"] * 1000, 4), "vs_dense": f"{times['dense'] / times['2:4']:.2f}x",
                     "note": f"dense {times['dense'] * 1000:.4f} ms"})  # fmt: skip
    return rows


def _time(run: Callable, repeats: int = 50) -> float:
    """Best seconds of one call (after warm-up), the GPU synchronized around each."""
    settle = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(repeats):
        settle()
        started = time.perf_counter()
        run()
        settle()
        best = min(best, time.perf_counter() - started)
    return best


def _fixed_memory_rows(model, kv_mb: float, prompt: int, new_tokens: int, bandwidth: float) -> list[dict]:
    """Dense and h2o (20% of each prompt held) at the largest batch that fits in `kv_mb` of KV."""
    per_token = kv_bytes_per_token(model, _kv_dtype(model))
    fits = {"full": int(kv_mb * 2**20 // (per_token * (prompt + new_tokens))),
            "h2o": int(kv_mb * 2**20 // (per_token * (prompt // 5 + 1)))}  # fmt: skip
    fixed = []
    for policy, batch in fits.items():
        budget = {"heavy": 0.1, "recent": 0.1} if policy == "h2o" else {}
        row = _decode_row(
            model,
            "fixed KV memory",
            f"{policy}, {kv_mb:.0f} MB",
            max(batch, 1),
            prompt,
            new_tokens,
            bandwidth,
            held=prompt // 5 if budget else None,
            kv=KVSpec.of(policy, **budget),
            prefill_chunk=512,
        )
        fixed.append(row)  # fmt: skip
    return _versus(fixed, fixed[0])


def _contextual_rows(
    model, context: int, new_tokens: int, bandwidth: float, sparsities: tuple[float, ...], compile: str
) -> list[dict]:
    """TEAL and neuron thresholds at each sparsity (and at batch 4, TEAL with one selection shared
    by the batch), against dense at the same batch, at batch 1 and 4; the model is left dense."""
    rows = []
    ids = torch.randint(10, model.config.vocab_size, (4, 128), device=model.device)
    for batch in (1, 4):
        base = _decode_row(model, "contextual", "dense", batch, context, new_tokens, bandwidth, compile=compile)
        group = [base]
        variants = [("teal", {}), ("threshold", {})]
        variants += [("teal", {"batch_selection": "shared"})] if batch > 1 else []
        for method, settings in variants:
            for sparsity in sparsities:
                text = ids if method != "teal" else None
                sparsify(model, method, sparsity, calibration=text, progress=False, **settings)
                label = f"{method} {sparsity:.0%}" + (" (shared selection)" if settings else "")
                group.append(_decode_row(model, "contextual", label, batch, context, new_tokens, bandwidth,
                                         compile=compile))  # fmt: skip
                densify(model)
        rows += _versus(group, base)
    return rows


def _pruning_rows(shape: str, device: torch.device, dtype: torch.dtype, samples: int, seqlen: int) -> list[dict]:
    """Wanda's and SparseGPT's time per decoder layer, on a two-layer model of `shape`."""
    rows = []
    for method in ("wanda", "sparsegpt"):
        pruned = random_llama(shape, device, dtype, layers=2)
        text = torch.randint(10, pruned.config.vocab_size, (samples, seqlen), device=device)
        report = prune(pruned, method, 0.5, calibration=text, progress=False)
        rows.append({"what": "pruning", "setting": f"{method} 50%, {samples} x {seqlen} tokens",
                     "ms": round(report.seconds / 2 * 1000, 1), "note": "per decoder layer"})  # fmt: skip
        del pruned
    return rows


def _long_context_rows(model, long_context: int, new_tokens: int, bandwidth: float, compile: str) -> list[dict]:
    """Streaming and H2O against the full cache after `long_context` tokens, each against the full one."""
    chunk = min(2048, long_context)
    long = [_decode_row(model, "long context", f"full, {long_context}", 1, long_context, new_tokens, bandwidth,
                        compile=compile, prefill_chunk=chunk)]  # fmt: skip
    for policy, budget, held in (("streaming", {"budget": 2048}, min(2048, long_context)),
                                 ("h2o", {"heavy": 0.1, "recent": 0.1}, long_context // 5)):  # fmt: skip
        setting = f"{policy}, {held} held of {long_context}"
        long.append(_decode_row(model, "long context", setting, 1, long_context, new_tokens, bandwidth, held=held,
                                kv=KVSpec.of(policy, **budget), compile=compile, prefill_chunk=chunk))  # fmt: skip
    return _versus(long, long[0])


def bench_gpu(
    shape: str = "llama3-8b",
    device: str | None = None,
    context: int = 512,
    long_context: int = 32768,
    new_tokens: int = 128,
    kv_mb: float = 16384,
    prompt: int = 1024,
    sparsities: tuple[float, ...] = (0.25, 0.4, 0.5),
    calibration: tuple[int, int] = (32, 512),
    compile: str = "always",
    out: Path = Path("results/bench_gpu"),
    progress: Callable[[str], None] = print,
) -> list[dict]:
    """Run every measurement; write `bench_gpu.md` and `bench_gpu.json` into `out`; return the rows."""
    device = pick_device(device)
    dtype = default_dtype(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    model = random_llama(shape, device, dtype)  # an unknown shape is an error before anything is measured
    bandwidth = read_bandwidth_gbs(1024 if device.type == "cuda" else 256, device=device)
    progress(f"{name}: {bandwidth:.0f} GB/s read; {shape} ({dtype}) built with random weights")
    rows: list[dict] = []

    progress("dense decode at batch 1")
    modes = ("never", "always") if compile == "always" else (compile,)
    dense = [_decode_row(model, "dense decode", f"context {context}", 1, context, new_tokens, bandwidth, compile=mode)
             for mode in modes]  # fmt: skip
    rows += _versus(dense, dense[-1])

    progress(f"streaming and h2o against dense at a {long_context}-token context")
    rows += _long_context_rows(model, long_context, new_tokens, bandwidth, compile)

    progress(f"throughput in {kv_mb:.0f} MB of KV")
    rows += _fixed_memory_rows(model, kv_mb, prompt, new_tokens, bandwidth)

    progress("contextual sparsity (TEAL, neuron thresholds) at batch 1 and 4")
    rows += _contextual_rows(model, context, new_tokens, bandwidth, sparsities, compile)

    progress("2:4 against dense")
    config = model.config
    rows += _semi_structured(device, dtype, config.intermediate_size, config.hidden_size)
    del model

    progress("pruning time per layer")
    rows += _pruning_rows(shape, device, dtype, *calibration)

    weights = "random (real shapes; contextual thresholds calibrated to keep the stated share)"
    meta = run_meta(shape=shape, device=name, dtype=str(dtype), bandwidth_gbs=round(bandwidth, 1), weights=weights)
    write_json(out / "bench_gpu.json", {"meta": meta, "rows": rows})
    header = (f"{shape}, random weights (timings are the shape's; contextual masks are calibrated to keep the "
              f"stated share), {dtype}, {name}, {meta['date']}, torch {meta['torch']}; read bandwidth probed in "
              f"the same run: {bandwidth:.0f} GB/s\n\n")  # fmt: skip
    write_text(out / "bench_gpu.md", header + markdown_table(rows, COLUMNS))
    return rows
