"""`sparsegen bench kv`: decode latency and memory of streaming vs re-computation vs dense.

Each configuration runs in its own process so that its peak RSS is its own. Streaming and dense
both decode through `model.generate()` after the same prefix of the embedded text; the sliding
window with re-computation re-encodes the last W tokens for every new token.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from sparsegen.bench.measure import in_process as _in_process
from sparsegen.bench.measure import read_bandwidth_gbs, weight_bytes
from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, plot_lines, run_meta

COLUMNS = [
    ("cache", "cache size W"),
    ("streaming_ms", "streaming ms/token"),
    ("recompute_ms", "recompute ms/token"),
    ("dense_ms", "dense ms/token"),
    ("recompute_ratio", "recompute / streaming"),
    ("dense_ratio", "dense / streaming"),
    ("streaming_of_bound", "streaming fraction of bound"),
    ("dense_of_bound", "dense fraction of bound"),
    ("streaming_rss", "streaming peak RSS MB"),
    ("recompute_rss", "recompute peak RSS MB"),
    ("dense_rss", "dense peak RSS MB"),
]


def _prefix(model_name: str, text: str, tokens: int, device: str | None = None):
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.loading import load

    model, tokenizer = load(model_name, device=device)
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=tokens)[None]
    return model, ids


def generate_latency(
    model_name: str,
    text: str,
    context: int,
    new_tokens: int,
    cache_size: int | None,
    threads: int,
    policy: str = "streaming",
    device: str | None = None,
):
    """Per-token latency of generate() after `context` tokens: a streaming cache of `cache_size`, or dense."""
    from transformers import DynamicCache, LogitsProcessorList

    from sparsegen.bench.measure import TokenClock
    from sparsegen.kv import make_cache, policy_attention
    from sparsegen.kv.spec import KVSpec
    from sparsegen.rss import peak_rss_mb

    torch.set_num_threads(threads)
    model, ids = _prefix(model_name, text, context, device=device)
    cache = DynamicCache() if cache_size is None else make_cache(model, KVSpec.of(policy, budget=cache_size))
    clock = TokenClock()
    with torch.inference_mode(), policy_attention(model):
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([clock]),
            pad_token_id=0,
        )
    return clock.decode_ms(), peak_rss_mb()


def recompute_latency(model_name: str, text: str, window: int, repeats: int, threads: int, device: str | None = None):
    """Per-token latency of the sliding window with re-computation: a fresh forward over W tokens."""
    from sparsegen.rss import peak_rss_mb

    torch.set_num_threads(threads)
    model, ids = _prefix(model_name, text, window + repeats, device=device)
    times = []
    with torch.inference_mode():
        for r in range(repeats):
            start = time.perf_counter()
            model(ids[:, r : r + window]).logits[:, -1].argmax(-1)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, peak_rss_mb()


def _stream_rss_worker(
    model_name: str,
    text: str,
    tokens: int,
    cache_size: int,
    chunk: int,
    every: int,
    threads: int,
    device: str | None = None,
):
    """RSS along a long stream through a streaming cache (text repeated as needed)."""
    from sparsegen.kv import make_cache, policy_attention
    from sparsegen.kv.spec import KVSpec
    from sparsegen.rss import current_rss_mb

    torch.set_num_threads(threads)
    model, ids = _prefix(model_name, text, min(tokens, 400_000), device=device)
    ids = ids[0].repeat((tokens + ids.numel() - 1) // ids.numel())[:tokens]
    cache = make_cache(model, KVSpec.of("streaming", budget=cache_size, sinks=4))
    samples = []
    with torch.inference_mode(), policy_attention(model):
        for start in range(0, tokens, chunk):
            model(ids[None, start : start + chunk], cache=cache, use_cache=True)
            done = min(tokens, start + chunk)
            if done % every < chunk or done == tokens:
                samples.append((done, current_rss_mb(), cache.kv_bytes() / 2**20))
    return samples


def bytes_per_step(model_name: str, device: str | None = None) -> tuple[float, float]:
    """MB of weights a decode step reads, and MB of KV per held token (fp32)."""
    from sparsegen.kv.footprint import kv_bytes_per_token
    from sparsegen.loading import load

    model, _ = load(model_name, device=device)
    return weight_bytes(model) / 1e6, kv_bytes_per_token(model, torch.float32) / 1e6


def _stream_table(entry: dict, cache: int) -> str:
    """RSS and KV MB along one stream through a streaming cache of `cache` tokens, under its heading."""
    samples = [{"tokens": t, "rss": r, "kv": k} for t, r, k in entry["samples"]]
    columns = [("tokens", "tokens streamed"), ("rss", "RSS MB"), ("kv", "KV MB")]
    return f"\nRSS along a {entry['tokens']}-token stream, cache {cache}:\n" + markdown_table(samples, columns)


def _plot_latency(rows: list[dict], context: int, path: Path, title: str) -> None:
    """ms per token against the cache size: streaming, re-computation, and dense after `context` tokens."""
    xs = [r["cache"] for r in rows]
    lines = {
        "streaming": (xs, [r["streaming_ms"] for r in rows]),
        "sliding window + re-computation": (xs, [r["recompute_ms"] for r in rows]),
        f"dense (full cache, {context}+ tokens)": (xs, [r["dense_ms"] for r in rows]),
    }
    plot_lines(lines, path, xlabel="cache size W (tokens)", ylabel="ms per generated token", title=title, logy=True)


def _size_row(
    size: int,
    context: int,
    measured: dict[str, tuple[float, float]],
    dense: tuple[float, float],
    megabytes: tuple[float, float],
    bandwidth: float,
) -> dict:
    """One cache size's row: the (ms, RSS) of streaming and recompute at that size (`measured`)
    against the dense cache's (`dense`), each latency against its byte bound (`megabytes`: the
    weights' MB and the KV's MB per token)."""
    (stream_ms, stream_rss), (recompute_ms, recompute_rss) = measured["streaming"], measured["recompute"]
    dense_ms, dense_rss = dense
    weight_mb, kv_mb_per_token = megabytes
    return {
        "cache": size,
        "streaming_ms": stream_ms,
        "recompute_ms": recompute_ms,
        "dense_ms": dense_ms,
        "recompute_ratio": recompute_ms / stream_ms,
        "dense_ratio": dense_ms / stream_ms,
        "streaming_of_bound": (weight_mb + size * kv_mb_per_token) / bandwidth / stream_ms,
        "dense_of_bound": (weight_mb + context * kv_mb_per_token) / bandwidth / dense_ms,
        "streaming_rss": stream_rss,
        "recompute_rss": recompute_rss,
        "dense_rss": dense_rss,
    }


def _memory_along_streams(
    model_name: str, text: str, stream_tokens: tuple[int, ...], cache: int, threads: int, device, progress
) -> list[dict]:
    """The RSS sampled along a stream of each length in `stream_tokens` under a streaming `cache`."""
    memory = []
    for tokens in stream_tokens:
        progress(f"RSS along a {tokens}-token stream (cache {cache})")
        samples = _in_process(
            _stream_rss_worker, model_name, text, tokens, cache, 256, max(1000, tokens // 20), threads, device=device
        )
        memory.append({"tokens": tokens, "samples": samples})
    return memory


def bench_kv(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    sizes: tuple[int, ...] = (256, 1024, 2048),
    context: int = 4096,
    new_tokens: int = 32,
    repeats: int = 5,
    stream_tokens: tuple[int, ...] = (),
    out: Path = Path("results/bench_kv"),
    threads: int | None = None,
    progress=print,
    also: tuple[str, ...] = (),
    device: str | None = None,
) -> dict:
    """Run the benchmark; write `bench_kv.md`, `bench_kv.json` and `bench_kv.png` into `out`.

    `also` names further policies whose decode latency is measured at each cache size too.
    """
    threads = threads or torch.get_num_threads()
    bandwidth = read_bandwidth_gbs()
    weight_mb, kv_mb_per_token = _in_process(bytes_per_step, model_name, device=device)
    rows = []
    progress(f"read bandwidth {bandwidth:.1f} GB/s; dense: generate() after {context} tokens")
    dense_ms, dense_rss = _in_process(
        generate_latency, model_name, text, context, new_tokens, None, threads, device=device
    )
    for size in sizes:
        progress(f"cache {size}: streaming after {context} tokens, recompute over {size}")
        stream_ms, stream_rss = _in_process(
            generate_latency, model_name, text, context, new_tokens, size, threads, device=device
        )
        recompute_ms, recompute_rss = _in_process(
            recompute_latency, model_name, text, size, repeats, threads, device=device
        )
        measured = {"streaming": (stream_ms, stream_rss), "recompute": (recompute_ms, recompute_rss)}
        rows.append(_size_row(size, context, measured, (dense_ms, dense_rss), (weight_mb, kv_mb_per_token), bandwidth))
        for policy in also:
            progress(f"cache {size}: {policy} after {context} tokens")
            rows[-1][f"{policy}_ms"] = _in_process(
                generate_latency, model_name, text, context, new_tokens, size, threads, policy, device=device
            )[0]
    memory = _memory_along_streams(model_name, text, stream_tokens, sizes[0], threads, device, progress)
    meta = run_meta(model=model_name, text=text, context=context, new_tokens=new_tokens, bandwidth_gbs=bandwidth)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_kv.json", {"meta": meta, "rows": rows, "memory": memory})
    lines = [
        f"decode after {context} tokens of `{text}`, model `{model_name}`, {meta['machine']}, {meta['date']}\n",
        markdown_table(rows, [*COLUMNS[:2], *((f"{p}_ms", f"{p} ms/token") for p in also), *COLUMNS[2:]]),
    ]
    lines += [_stream_table(entry, sizes[0]) for entry in memory]
    write_text(out / "bench_kv.md", "".join(lines))
    _plot_latency(rows, context, out / "bench_kv.png", title=f"{model_name}: decode latency vs cache size")
    return {"meta": meta, "rows": rows, "memory": memory}
