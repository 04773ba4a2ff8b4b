"""The main job: compare KV policies on one long stream, past the model's pretrained window.

A stream may run for millions of tokens (StreamingLLM's 4M): the texts named are read in turn and
again from the start as often as the length asks (the meta says how often), the process's memory
is sampled along the way, and perplexity is reported per million tokens."""

from __future__ import annotations

import dataclasses
import math
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from sparsegen.data import load_text, tokenize_long
from sparsegen.errors import SparsegenError
from sparsegen.eval.stream_ppl import PolicyRun, StreamResult, stream_compare
from sparsegen.ioutil import write_json
from sparsegen.kv import POLICIES
from sparsegen.kv.quantized import checked_bits
from sparsegen.kv.spec import KVSpec
from sparsegen.loading import load
from sparsegen.report import plot_lines, running_mean
from sparsegen.rss import current_rss_mb, peak_rss_mb

MILLION = 1_000_000
RSS_SAMPLES = 40
"""How many times along a stream the process's resident memory is read."""

STREAM_COLUMNS = [
    ("label", "policy"),
    ("position", "positions"),
    ("tokens", "tokens"),
    ("ppl_in_window", "ppl ≤ window"),
    ("ppl_past_window", "ppl > window"),
    ("ppl", "ppl all"),
    ("kl", "KL vs full"),
    ("top1", "top-1 agree"),
    ("kv_mb", "KV MB"),
    ("tokens_per_s", "tok/s"),
    ("note", "note"),
]


@dataclass(frozen=True)
class StreamJob:
    """What the main job compares: `model` reads `text` (a text name or file, or several separated
    by commas, read in turn and again as often as `tokens` needs) for `tokens` tokens, `chunk` at a
    time, under each of `specs` (`compared_specs`), on `device`. A second run of the same job
    resumes."""

    model: str
    text: str
    specs: tuple[KVSpec, ...]
    tokens: int = 20000
    chunk: int = 256
    device: str | None = None

    def __post_init__(self) -> None:
        if not self.specs or self.specs[0].name != "full":
            raise SparsegenError("the main job's specs start with full, its reference (compared_specs)")


def compared_specs(
    policies: list[str], total: int, sinks: int | None = None, position: str | None = None, bits: tuple[int, ...] = ()
) -> tuple[KVSpec, ...]:
    """The specs one comparison runs: `full` first (the reference), then every policy at the same
    `total` budget, split by each as the kv rule says; `sinks` go to the policies that keep sinks
    (one comparison runs them beside policies that keep none). Each of `bits` adds every bounded
    policy again with its KV held in those bits."""
    names = ["full", *(name for name in policies if name != "full")]
    specs = []
    for name in names:
        if POLICIES.named(name).prefill_only:
            raise SparsegenError(
                f"{name} compresses a prompt once and then keeps every token, so it cannot bound a stream; "
                "compare it with `sparsegen eval needle` or `eval zeroshot`"
            )
        if name == "full":
            specs.append(KVSpec.of("full"))
            continue
        kept = sinks if "sinks" in POLICIES[name].budget_parts() else None
        specs.append(KVSpec.of(name, budget=total, sinks=kept, position=position))
    bounded = [spec for spec in specs if spec.name != "full"]
    return (*specs, *(dataclasses.replace(spec, kv_bits=checked_bits(b)) for b in bits for spec in bounded))


def _runs(specs: tuple[KVSpec, ...], model_window: int) -> list[PolicyRun]:
    """A run per spec, labelled by its policy (and bits); full stops at the model's window."""
    runs = []
    for spec in specs:
        label = spec.name if spec.kv_bits is None else f"{spec.name}-int{spec.kv_bits}"
        if spec.name == "full":
            note = f"stops at the model's {model_window}-token window"
            runs.append(PolicyRun(label, spec, max_tokens=model_window, note=note))
        else:
            runs.append(PolicyRun(label, spec))
    return runs


def text_names(text: str) -> list[str]:
    """The texts `text` names, commas between them; a one-line error where it names none."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise SparsegenError("--text names no text: give an embedded name or a .txt file (several: commas)")
    return names


def stream_ids(tokenizer, text: str, tokens: int) -> tuple[torch.Tensor, int]:
    """`tokens` ids of the texts named in `text` (`text_names`), read in turn and again from the
    start as often as needed, and how many of them are distinct (the texts' own length)."""
    joined = "\n\n".join(load_text(name) for name in text_names(text))
    ids = tokenize_long(tokenizer, joined, max_tokens=tokens)
    if ids.numel() < 2:
        raise SparsegenError(f"{text!r} holds fewer than 2 tokens: give a longer text")
    distinct = ids.numel()
    return ids.repeat(-(-tokens // distinct))[:tokens], distinct


def per_million(nll, tokens: int = MILLION) -> list[float]:
    """Perplexity of each whole or last partial block of `tokens` scored tokens."""
    return [math.exp(sum(nll[i : i + tokens]) / len(nll[i : i + tokens])) for i in range(0, len(nll), tokens)]


def stream_job(job: StreamJob, out: Path, progress: bool = True) -> dict[str, StreamResult]:
    """Run the comparison, write results.json, NLL files and the plot into `out`; return results."""
    model_name, text, tokens, chunk = job.model, job.text, job.tokens, job.chunk
    model, tokenizer = load(model_name, device=job.device)
    model_window = model.config.get_text_config().max_position_embeddings
    runs = _runs(job.specs, model_window)
    ids, distinct = stream_ids(tokenizer, text, tokens)
    torch.manual_seed(0)
    started = time.time()
    every = max(chunk, tokens // RSS_SAMPLES)
    rss: list[tuple[int, float, float]] = []  # tokens streamed, resident MB now, at its peak so far

    def sample_rss(done: int) -> None:
        if done // every != (done - chunk) // every or done >= ids.numel() - 1:
            rss.append((done, round(current_rss_mb(), 1), round(peak_rss_mb(), 1)))

    results = stream_compare(
        model, ids, runs, chunk=chunk, reference="full", out_dir=out, progress=progress,
        checkpoint_every=max(4096, tokens // 256), watch=sample_rss,
    )  # fmt: skip
    rows = {}
    for label, result in results.items():
        row = result.summary()
        # Scored token i is predicted at position i: the first `model_window` are made within the window.
        row["ppl_in_window"] = result.ppl_between(0, model_window)
        row["ppl_past_window"] = result.ppl_between(model_window) if result.tokens > model_window else None
        row["ppl_per_million"] = per_million(result.nll)
        rows[label] = row
    write_json(out / "results.json", rows)
    meta = {
        "model": model_name,
        "text": text,
        "tokens": int(ids.numel()),
        "distinct_tokens": distinct,
        "text_passes": round(ids.numel() / distinct, 3),
        "chunk": chunk,
        "model_window": model_window,
        "seconds": round(time.time() - started, 1),
        "rss_mb": rss,
        "torch": torch.__version__,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }
    write_json(out / "meta.json", meta)
    smooth = max(256, tokens // 4000)
    plot_lines(
        {label: running_mean(r.nll, smooth) for label, r in results.items()},
        out / "stream_nll.png",
        xlabel="token position in the stream",
        ylabel=f"NLL (log-perplexity), mean of {smooth} tokens",
        title=f"{model_name} on {text}, chunk {chunk}",
        vline=model_window,
        vline_label="pretrained window",
    )
    return results
