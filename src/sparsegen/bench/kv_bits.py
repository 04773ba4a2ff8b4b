"""`sparsegen bench kv-bits`: what holding keys and values in 8 or 4 bits costs and saves.

Per context length and policy (full, streaming, h2o), the fast path's compiled decode step with
its KV in fp32, int8 and int4, each in a process of its own: ms per token, KV bytes held, the
byte bound (weights + KV read once per step at the bandwidth probed in the same run), and the
speed against the same policy with fp32 KV.
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparsegen.bench.decode import bound_of, fast_decode_worker
from sparsegen.bench.measure import in_process, read_bandwidth_gbs
from sparsegen.ioutil import write_json, write_text
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
                    policy,
                    budget_of(policy, cache),
                    1,
                    threads,
                    device=device,
                    kv_bits=bits,
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
