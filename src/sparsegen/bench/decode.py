"""`sparsegen bench decode` and `sparsegen bench throughput`: the fast path against generate(), and
against the machine's memory bound.

The bound: a batch-1 decode step must read every weight once and every held key and value, so it
cannot beat (weight bytes + KV bytes) / read bandwidth, with the bandwidth probed in the same run.
Each configuration runs in its own process (its own peak RSS, no shared warm caches).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from sparsegen.bench.kv import bytes_per_step, generate_latency
from sparsegen.bench.measure import in_process as _in_process
from sparsegen.bench.measure import read_bandwidth_gbs, weight_bytes
from sparsegen.bench.peers.llamacpp import llama_cpp_row
from sparsegen.bench.quantized import (
    integer_dot_quality_worker,
    quality_worker,
    quantized_checkpoints,
)
from sparsegen.data import text_stretches
from sparsegen.ioutil import write_json, write_text
from sparsegen.kv.footprint import kv_bytes_per_token, kv_ring_bytes
from sparsegen.kv.spec import KVSpec
from sparsegen.models import DTYPES
from sparsegen.report import markdown_table, run_meta


def fast_decode_worker(
    model_name,
    text,
    context,
    new_tokens,
    dtype,
    kv: KVSpec | str,
    rows,
    threads,
    device: str | None = None,
    activation_bits: int | None = None,
) -> dict:
    """Per-step time of the fast path after `context` tokens per row under the KV spec `kv` (a
    packed checkpoint's products as integer dots with `activation_bits=8`), and the first row's tokens."""

    from sparsegen.decode import Decoder, generate
    from sparsegen.loading import load
    from sparsegen.rss import peak_rss_mb

    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, dtype=DTYPES[dtype], device=device, activation_bits=activation_bits)
    prompts = text_stretches(tokenizer, text, rows, context)
    kv = KVSpec.coerce(kv)
    decoder = Decoder(model, kv, compile="always")  # kept: its KV dtype is chosen as rows join
    warm = generate(model, prompts, 8, kv, eos_token_id=[], decoder=decoder)  # compiles; first steps are slower
    out = generate(model, prompts, new_tokens, kv, eos_token_id=[], decoder=decoder)
    kv_dtype = decoder.kv_dtype
    decoder.release()
    held = min(context, kv.policy.sizes(context).budget) if kv.policy.budget_parts() else context
    return {
        "ms": out.ms_per_step,
        "tokens_per_s": out.tokens_per_s,
        "compile_s": warm.compile_s,
        "prefill_s": out.prefill_s,
        "rss": peak_rss_mb(),
        "weight_mb": weight_bytes(model) / 1e6,
        "kv_mb": rows * (held + new_tokens // 2) * kv_bytes_per_token(model, kv_dtype, kv.kv_bits) / 1e6,
        "kv_dtype": str(kv_dtype).removeprefix("torch."),
        "tokens": [int(token) for token in out.tokens[0]],
    }


def _bf16_quality_worker(model_name, text, seqlen, windows, kv_tokens, threads, device: str | None = None) -> dict:
    """What bf16 costs: perplexity and top-1 agreement with fp32, for bf16 weights (whole windows)
    and for a bf16 KV cache under fp32 weights (teacher-forced through the decode step)."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.decode import Decoder
    from sparsegen.kv import policy_attention
    from sparsegen.loading import load

    torch.set_num_threads(threads)
    model, tokenizer = load(model_name, device=device)
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=seqlen * windows).view(windows, seqlen)

    def nll_and_top1(logits: torch.Tensor, targets: torch.Tensor):
        return torch.nn.functional.cross_entropy(logits, targets, reduction="sum").item(), logits.argmax(-1)

    with torch.inference_mode():
        fp32 = [model(ids[w : w + 1]).logits[0, :-1].float() for w in range(windows)]
        low = model.to(torch.bfloat16)
        bf16 = [low(ids[w : w + 1]).logits[0, :-1].float() for w in range(windows)]
        model.to(torch.float32)
    targets = ids[:, 1:].reshape(-1)
    nll32, top32 = nll_and_top1(torch.cat(fp32), targets)
    nll16, top16 = nll_and_top1(torch.cat(bf16), targets)
    forced = ids[0, : kv_tokens + 1].tolist()
    steps = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        decoder = Decoder(model, "full", compile="never", kv_dtype=dtype)
        with policy_attention(model):
            rows = [decoder.start([forced[:1]], kv_tokens)[0]]
            rows += [decoder.step(torch.tensor([token]))[0] for token in forced[1:-1]]
        steps[name] = torch.stack(rows)
    kv_targets = torch.tensor(forced[1:])
    kv32, kv_top32 = nll_and_top1(steps["fp32"], kv_targets)
    kv16, kv_top16 = nll_and_top1(steps["bf16"], kv_targets)
    n, m = targets.numel(), kv_targets.numel()
    return {
        "weights_ppl_fp32": float(torch.tensor(nll32 / n).exp()),
        "weights_ppl_bf16": float(torch.tensor(nll16 / n).exp()),
        "weights_top1_agreement": (top32 == top16).float().mean().item(),
        "kv_ppl_fp32": float(torch.tensor(kv32 / m).exp()),
        "kv_ppl_bf16": float(torch.tensor(kv16 / m).exp()),
        "kv_top1_agreement": (kv_top32 == kv_top16).float().mean().item(),
        "tokens": n,
        "kv_tokens": m,
    }


def bound_of(row: dict, bandwidth: float) -> dict:
    bound_ms = (row["weight_mb"] + row["kv_mb"]) / 1e3 / bandwidth * 1e3
    return {**row, "bound_ms": bound_ms, "of_bound": bound_ms / row["ms"]}


def _fast_runs(
    model_name: str, folders: dict[str, Path], context: int, long_context: int, cache: int
) -> list[tuple[str, str, KVSpec | str, int, str, dict]]:
    """The fast path's configurations as (model, dtype, KV spec, context, label, worker options):
    fp32, bf16 weights and each packed checkpoint at `context` (int4 also with integer-dot
    products), then dense and streaming after `long_context`."""
    runs = [(model_name, "fp32", "full", context, f"fast fp32, {context} ctx", {})]
    runs += [(model_name, "bf16", "full", context, f"fast bf16 weights, {context} ctx", {})]
    for label, path in folders.items():
        runs += [(str(path), "fp32", "full", context, f"fast {label} packed, {context} ctx", {})]
        if label == "int4":
            dots = f"fast int4 integer-dot, {context} ctx"
            runs += [(str(path), "fp32", "full", context, dots, {"activation_bits": 8})]
    if long_context:
        stream = KVSpec.of("streaming", sinks=4, recent=cache - 4)
        runs += [(model_name, "fp32", "full", long_context, f"fast fp32 dense, {long_context} ctx", {})]
        label = f"fast fp32 streaming 4+{cache - 4}, after {long_context}"
        runs += [(model_name, "fp32", stream, long_context, label, {})]
    return runs


def _streaming_against_dense(rows: list[dict], long_context: int) -> tuple[dict, str]:
    """How much faster streaming decodes than dense after `long_context` tokens, against what the
    bytes each step reads allow; and that said in a sentence."""
    dense, stream = (next(r for r in rows if r["config"].startswith(f"fast fp32 {k}")) for k in ("dense", "streaming"))
    byte_ratio = (dense["weight_mb"] + dense["kv_mb"]) / (stream["weight_mb"] + stream["kv_mb"])
    measured = dense["ms"] / stream["ms"]
    note = (
        f"streaming vs dense after {long_context} tokens: {measured:.2f}x measured, {byte_ratio:.2f}x allowed "
        f"by the byte model: {100 * measured / byte_ratio:.0f}% of it"
    )
    return {"byte_model_ratio": byte_ratio, "measured_ratio": measured, "of_byte_model": measured / byte_ratio}, note


def _packed_quality(
    folders: dict[str, Path], quality_text: str, threads: int, device: str | None
) -> tuple[dict[str, dict], list[str]]:
    """Each packed checkpoint's perplexity against its dequantized self, each in its own process; and
    a sentence per checkpoint."""
    quality = {
        label: _in_process(quality_worker, str(path), quality_text, 1024, 4, threads, device=device)
        for label, path in folders.items()
    }
    notes = [
        f"{label} packed: perplexity {q['ppl_packed']:.3f} vs {q['ppl_dequantized']:.3f} dequantized "
        f"({100 * q['ppl_change']:+.2f}%, {q['tokens']} tokens of {quality_text})"
        for label, q in quality.items()
    ]
    if "int4" in folders and device in (None, "cpu"):
        dots = _in_process(integer_dot_quality_worker, str(folders["int4"]), quality_text, 2048, threads)
        quality["int4 integer-dot"] = dots
        notes.append(
            f"int4 integer-dot against int4 weight-only, 16 tokens a forward: perplexity {dots['ppl_integer_dot']:.3f}"
            f" vs {dots['ppl_weight_only']:.3f} ({100 * dots['ppl_change']:+.2f}%, {dots['tokens']} tokens)"
        )
    return quality, notes


def _bf16_note(quality: dict) -> str:
    """What `_bf16_quality_worker` measured, in a sentence."""
    return (
        f"bf16 weights: perplexity {quality['weights_ppl_fp32']:.3f} -> {quality['weights_ppl_bf16']:.3f}, "
        f"top-1 agreement {100 * quality['weights_top1_agreement']:.2f}% ({quality['tokens']} tokens); "
        f"bf16 KV cache: {quality['kv_ppl_fp32']:.3f} -> {quality['kv_ppl_bf16']:.3f}, "
        f"top-1 agreement {100 * quality['kv_top1_agreement']:.2f}% ({quality['kv_tokens']} tokens)"
    )


DECODE_COLUMNS = [
    ("config", "configuration"),
    ("ms", "ms/token"),
    ("speedup", "vs generate() fp32"),
    ("vs_fast_fp32", "vs fast fp32"),
    ("weight_mb", "weights MB"),
    ("kv_mb", "KV MB"),
    ("bound_ms", "bound ms"),
    ("of_bound", "fraction of bound"),
    ("compile_s", "compile s"),
    ("rss", "peak RSS MB"),
]


def _llama_cpp_row(
    llama_cpp: str, model_name: str, text: str, context: int, new_tokens: int, threads: int, kv_mb: float, device
) -> dict:
    """llama.cpp's row: the same `context` tokens of `text` decoded by the model's GGUF under the
    interpreter `llama_cpp`, with the KV it holds (`kv_mb`)."""
    from sparsegen.loading import load

    prompt = text_stretches(load(model_name, device=device)[1], text, 1, context)[0]
    theirs = llama_cpp_row(llama_cpp, model_name, prompt, new_tokens, threads)
    return {"config": f"llama.cpp {theirs['gguf']}, {context} ctx", **theirs, "kv_mb": kv_mb}


def _against_baselines(rows: list[dict], base_ms: float) -> list[dict]:
    """Each row's speed against generate() (`base_ms`, `speedup`) and the fast path's fp32 row, the
    second (`vs_fast_fp32`)."""
    for row in rows:
        row["speedup"] = base_ms / row["ms"]
    fast = rows[1]
    for row in rows:
        row["vs_fast_fp32"] = fast["ms"] / row["ms"]
    return rows


def bench_decode(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    context: int = 1024,
    long_context: int = 8000,
    new_tokens: int = 96,
    cache: int = 1024,
    threads: int | None = None,
    out: Path = Path("results/bench_decode"),
    progress=print,
    quantized: bool = True,
    llama_cpp: str | None = None,
    quality_text: str = "milton",
    device: str | None = None,
) -> dict:
    """generate() vs the fast path (fp32, bf16 weights, and int8 / int4 packed checkpoints with
    their perplexity on `quality_text` against their dequantized selves; llama.cpp on the model's
    GGUF under the interpreter `llama_cpp`) at `context`, then streaming (4 sinks + the rest of
    `cache`) vs dense after `long_context` tokens (0: skipped), each against the byte model."""
    threads = threads or torch.get_num_threads()
    bandwidth = read_bandwidth_gbs()
    progress(f"read bandwidth {bandwidth:.1f} GB/s; generate() fp32 after {context} tokens")
    ms, rss = _in_process(generate_latency, model_name, text, context, new_tokens, None, threads, device=device)
    weight_mb, kv_mb_per_token = _in_process(bytes_per_step, model_name, device=device)
    base = {"ms": ms, "rss": rss, "weight_mb": weight_mb, "kv_mb": (context + new_tokens // 2) * kv_mb_per_token}
    rows = [{"config": f"generate() fp32, {context} ctx", **base}]
    folders = _in_process(quantized_checkpoints, model_name, out, device=device) if quantized else {}
    for name, dtype, kv, length, label, options in _fast_runs(model_name, folders, context, long_context, cache):
        progress(label)
        worker_args = (name, text, length, new_tokens, dtype, kv, 1, threads)
        result = _in_process(fast_decode_worker, *worker_args, device=device, **options)
        rows.append({"config": label, **result})
    if llama_cpp:
        progress(f"llama.cpp under {llama_cpp}")
        kv_mb = (context + new_tokens // 2) * kv_mb_per_token / 2  # llama.cpp keeps keys and values in fp16
        rows.append(_llama_cpp_row(llama_cpp, model_name, text, context, new_tokens, threads, kv_mb, device))
    rows = _against_baselines([bound_of(row, bandwidth) for row in rows], base["ms"])
    result = {"rows": rows}
    notes = []
    if long_context:
        result["streaming"], note = _streaming_against_dense(rows, long_context)
        notes.append(note)
    if folders:
        progress(f"quantized perplexity on {quality_text}: packed vs dequantized")
        result["quantized"], quantized_notes = _packed_quality(folders, quality_text, threads, device)
        notes += quantized_notes
    progress("what bf16 costs: perplexity and top-1 agreement with fp32")
    quality = _in_process(_bf16_quality_worker, model_name, text, 1024, 4, 256, threads, device=device)
    result["bf16"] = quality
    notes.append(_bf16_note(quality))
    meta = run_meta(model=model_name, text=text, bandwidth_gbs=bandwidth, new_tokens=new_tokens)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_decode.json", {"meta": meta, **result})
    write_text(
        out / "bench_decode.md",
        f"`{model_name}`, `{text}`, {meta['machine']}, {meta['date']}, read bandwidth {bandwidth:.1f} GB/s\n\n"
        + markdown_table(rows, DECODE_COLUMNS)
        + "".join(f"\n{note}\n" for note in notes),
    )
    return {"meta": meta, **result}


THROUGHPUT_COLUMNS = [
    ("config", "cache"),
    ("batch", "batch that fits"),
    ("kv_mb", "KV held MB"),
    ("tokens_per_s", "tokens/s"),
    ("ms", "ms/step"),
    ("prefill_s", "prefill s"),
    ("compile_s", "compile s"),
    ("rss", "peak RSS MB"),
]


def bench_throughput(
    model_name: str = "smollm2-135m",
    text: str = "shakespeare",
    prompt: int = 1024,
    new_tokens: int = 64,
    kv_mb: float = 256.0,
    heavy_share: float = 0.1,
    max_batch: int = 32,
    threads: int | None = None,
    out: Path = Path("results/bench_throughput"),
    progress=print,
    device: str | None = None,
    kv_bits: tuple[int, ...] = (),
) -> dict:
    """H2O's headline experiment: in one KV memory budget, the largest batch that fits for dense,
    h2o (heavy + recent = 2 x `heavy_share` of the prompt), and streaming of the same size; then
    tokens/s of each at that batch. Each of `kv_bits` adds the three with their KV in those bits
    (a rounded row counted with its ring of newest tokens, as the server admits it)."""
    from sparsegen.loading import load

    threads = threads or torch.get_num_threads()
    model, _ = load(model_name, device=device)
    per_token = {bits: kv_bytes_per_token(model, kv_bits=bits) for bits in (None, *kv_bits)}
    ring = {bits: kv_ring_bytes(model, bits) for bits in per_token}  # a rounded row's newest tokens
    del model

    def row_bytes(bits: int | None, slots: int) -> int:
        return slots * per_token[bits] + ring[bits]

    share = int(heavy_share * prompt)
    configs = [
        ("dense", KVSpec.of("full"), -(-(prompt + new_tokens) // 64) * 64),
        (f"h2o {2 * share} ({200 * heavy_share:.0f}%)", KVSpec.of("h2o", heavy=share, recent=share), 2 * share + 1),
        (f"streaming 4+{2 * share - 4}", KVSpec.of("streaming", sinks=4, recent=2 * share - 4), 2 * share + 1),
    ]
    rows = []
    for bits, (label, kv, slots) in ((bits, c) for bits in per_token for c in configs):
        label += "" if bits is None else f", KV int{bits}"
        batch = min(max_batch, int(kv_mb * 1e6 // row_bytes(bits, slots)))
        if batch < 1:
            rows.append({"config": label, "batch": 0})
            continue
        progress(f"{label}: batch {batch}")
        held_in = dataclasses.replace(kv, kv_bits=bits)
        worker_args = (model_name, text, prompt, new_tokens, "fp32", held_in, batch, threads)
        result = _in_process(fast_decode_worker, *worker_args, device=device)
        rows.append({"config": label, "batch": batch, **result, "kv_mb": batch * row_bytes(bits, slots) / 1e6})
    meta = run_meta(model=model_name, text=text, prompt=prompt, new_tokens=new_tokens, kv_budget_mb=kv_mb)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "bench_throughput.json", {"meta": meta, "rows": rows})
    write_text(
        out / "bench_throughput.md",
        f"`{model_name}`, prompts of {prompt} tokens, {new_tokens} new, KV budget {kv_mb:.0f} MB, "
        f"{meta['machine']}, {meta['date']}\n\n" + markdown_table(rows, THROUGHPUT_COLUMNS),
    )
    return {"meta": meta, "rows": rows}
