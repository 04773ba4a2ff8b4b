"""`sparsegen bench kv-bits`: what holding keys and values in 8, 4, 3 or 2 bits costs and saves.

Per context length and policy (full, streaming, h2o), the fast path's compiled decode step with
its KV in fp32 and each width, each in a process of its own: ms per token, KV bytes held, the
byte bound (weights + KV read once per step at the bandwidth probed in the same run), and the
speed against the same policy with fp32 KV. With `--quality`, perplexity instead: each width
rounded with and without the rotation (`kv.quantized`), against fp32 KV.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from sparsegen.bench.decode import bound_of, fast_decode_worker
from sparsegen.bench.measure import in_process, read_bandwidth_gbs
from sparsegen.ioutil import write_json, write_text
from sparsegen.kv.spec import KVSpec
from sparsegen.report import markdown_table, run_meta

COLUMNS = [
    ("context", "context"),
    ("policy", "policy"),
    ("kv", "KV"),
    ("ms", "ms/token"),
    ("vs_fp32_kv", "speed vs fp32 KV"),
    ("kv_mb", "KV MB"),
    ("bound_ms", "bound ms"),
    ("of_bound", "fraction of bound"),
    ("compile_s", "compile s"),
    ("rss", "peak RSS MB"),
]


def budget_of(policy: str, cache: int) -> dict:
    """The policy's parts for a cache of `cache` tokens (full: every token)."""
    if policy == "full":
        return {}
    if policy == "streaming":
        return {"sinks": 4, "recent": cache - 4}
    return {"heavy": cache // 2, "recent": cache - cache // 2}


def bench_kv_bits(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    contexts: tuple[int, ...] = (1024, 8000),
    policies: tuple[str, ...] = ("full", "streaming", "h2o"),
    widths: tuple[int | None, ...] = (None, 8, 4),
    cache: int = 512,
    new_tokens: int = 64,
    threads: int | None = None,
    out: Path = Path("results/bench_kv_bits"),
    progress=print,
    device: str | None = None,
) -> dict:
    """Every context x policy x bit width (None: fp32), batch 1; bounded policies keep `cache` tokens."""
    threads = threads or torch.get_num_threads()
    widths = (None, *(bits for bits in widths if bits is not None))  # fp32 first: each row's baseline
    bandwidth = read_bandwidth_gbs()
    progress(f"read bandwidth {bandwidth:.1f} GB/s")
    rows = []
    for context in contexts:
        for policy in policies:
            for bits in widths:
                kv = "fp32" if bits is None else f"int{bits}"
                progress(f"{policy} after {context} tokens, KV {kv}")
                result = in_process(
                    fast_decode_worker,
                    model_name,
                    text,
                    context,
                    new_tokens,
                    "fp32",
                    KVSpec.of(policy, kv_bits=bits, **budget_of(policy, cache)),
                    1,
                    threads,
                    device=device,
                )
                rows.append(bound_of({"context": context, "policy": policy, "kv": kv, **result}, bandwidth))
    for row in rows:
        fp32 = next(r for r in rows if (r["context"], r["policy"], r["kv"]) == (row["context"], row["policy"], "fp32"))
        row["vs_fp32_kv"] = fp32["ms"] / row["ms"]
    meta = run_meta(model=model_name, text=text, bandwidth_gbs=bandwidth, new_tokens=new_tokens, cache=cache)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_kv_bits.json", {"meta": meta, "rows": rows})
    write_text(
        out / "bench_kv_bits.md",
        f"`{model_name}`, `{text}`, bounded policies keep {cache} tokens, {meta['machine']}, {meta['date']}, "
        f"read bandwidth {bandwidth:.1f} GB/s\n\n" + markdown_table(rows, COLUMNS),
    )
    return {"meta": meta, "rows": rows}


QUALITY_COLUMNS = [
    ("policy", "policy"),
    ("kv", "KV"),
    ("rotated", "rotated"),
    ("ppl", "ppl"),
    ("vs_fp32_kv", "vs fp32 KV"),
    ("standard_error", "± 1 s.e."),
    ("kl_millinats", "KL to fp32 KV (millinats)"),
    ("kv_mb", "KV MB"),
]


def bench_kv_bits_quality(
    model_name: str = "smollm2-135m",
    text: str = "milton",
    tokens: int = 2048,
    policies: tuple[str, ...] = ("full", "streaming"),
    widths: tuple[int, ...] = (8, 4, 3, 2),
    cache: int = 1024,
    chunk: int = 16,
    out: Path = Path("results/bench_kv_bits"),
    progress=print,
    device: str | None = None,
) -> dict:
    """Perplexity of `tokens` tokens of `text` per policy x bit width, each rounded with and without
    the rotation (`kv.quantized`), against the same policy with fp32 KV: the change, its standard
    error over the scored tokens (the paired NLL differences'), and the mean KL divergence of each
    next-token distribution from fp32 KV's (what the rounding costs, without the sampling noise of
    which tokens the text happens to hold). Read `chunk` tokens a forward: the ring holds each row's
    first 16 and newest 32 tokens at full precision, so a chunk up to 32 changes little of what the
    rounding reaches. Weights in fp32 (a GGUF's blocks dequantized), so that the KV's is the only rounding
    measured. Quality only: no time is taken."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.loading import load

    model, tokenizer = load(model_name, dtype=torch.float32, device=device, gguf_blocks=False)
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=tokens).to(next(model.parameters()).device)
    settings = [(bits, rotated) for bits in widths for rotated in (True, False)]
    rows = []
    for policy in policies:
        progress(f"{policy}, KV fp32")
        reference = _read_text(model, ids, KVSpec.of(policy, **budget_of(policy, cache)), chunk)
        rows.append(_quality_row(policy, None, False, reference, None))
        for bits, rotated in settings:
            progress(f"{policy}, KV int{bits}{' rotated' if rotated else ''}")
            spec = KVSpec.of(policy, kv_bits=bits, kv_rotated=rotated, **budget_of(policy, cache))
            rows.append(_quality_row(policy, bits, rotated, _read_text(model, ids, spec, chunk, reference), reference))
    meta = run_meta(model=model_name, text=text, tokens=int(ids.numel()), chunk=chunk, cache=cache)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_kv_bits_quality.json", {"meta": meta, "rows": rows})
    write_text(
        out / "bench_kv_bits_quality.md",
        f"`{model_name}`, {ids.numel()} tokens of `{text}` read {chunk} a forward, bounded policies keep "
        f"{cache} tokens, {meta['machine']}, {meta['date']}\n\n" + markdown_table(rows, QUALITY_COLUMNS),
    )
    return {"meta": meta, "rows": rows}


def _quality_row(policy: str, bits: int | None, rotated: bool, read: dict, reference: dict | None) -> dict:
    """One table row: perplexity, and against fp32 KV (`reference`) its change, that change's
    standard error and the mean KL (in thousandths of a nat)."""
    row = {"policy": policy, "kv": "fp32" if bits is None else f"int{bits}", "rotated": rotated}
    row |= {"ppl": math.exp(float(read["nll"].mean())), "kv_mb": read["peak"] / 2**20}
    if reference is None:
        return row | {"vs_fp32_kv": "+0.00%", "standard_error": "", "kl_millinats": 0.0}
    change = (read["nll"] - reference["nll"]).double()
    row["vs_fp32_kv"] = f"{100 * math.expm1(float(change.mean())):+.2f}%"
    row["standard_error"] = f"{100 * float(change.std()) / math.sqrt(change.numel()):.2f}%"
    return row | {"kl_millinats": 1000 * float(read["kl"].double().mean())}


@torch.inference_mode()
def _read_text(model, ids, spec: KVSpec, chunk: int, reference: dict | None = None) -> dict:
    """`ids` read `chunk` at a time into a fresh cache of `spec`: each scored token's NLL, the
    log-probabilities (where no `reference` is given) or the KL of each next-token distribution
    from the reference's, and the cache's peak bytes."""
    from sparsegen.kv import make_cache, policy_attention

    cache = make_cache(model, spec)
    nll, kl, log_probs, peak = [], [], [], 0
    with policy_attention(model):
        for start in range(0, ids.numel() - 1, chunk):
            stop = min(start + chunk, ids.numel() - 1)
            logits = model(input_ids=ids[None, start:stop], cache=cache, use_cache=True).logits[0].float()
            here = logits.log_softmax(-1)
            nll.append(-here.gather(1, ids[start + 1 : stop + 1, None])[:, 0])
            if reference is None:
                log_probs.append(here)
            else:
                there = reference["log_probs"][start:stop]
                kl.append((there.exp() * (there - here)).sum(-1))
            peak = max(peak, cache.kv_bytes())
    out = {"nll": torch.cat(nll), "peak": peak}
    return out | ({"log_probs": torch.cat(log_probs)} if reference is None else {"kl": torch.cat(kl)})
