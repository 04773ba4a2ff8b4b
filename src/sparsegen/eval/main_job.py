"""The main job: compare KV policies on one long stream, past the model's pretrained window."""

from __future__ import annotations

import dataclasses
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
    """What the main job compares: `model` reads `text` for `tokens` tokens, `chunk` at a time,
    under each of `specs` (`compared_specs`), on `device`. A second run of the same job resumes."""

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


def stream_job(job: StreamJob, out: Path, progress: bool = True) -> dict[str, StreamResult]:
    """Run the comparison, write results.json, NLL files and the plot into `out`; return results."""
    model_name, text, tokens, chunk = job.model, job.text, job.tokens, job.chunk
    model, tokenizer = load(model_name, device=job.device)
    model_window = model.config.get_text_config().max_position_embeddings
    runs = _runs(job.specs, model_window)
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=tokens)
    if ids.numel() < tokens:
        raise SparsegenError(f"the text has only {ids.numel()} tokens, fewer than --tokens {tokens}")
    torch.manual_seed(0)
    reference = "full"
    started = time.time()
    results = stream_compare(model, ids, runs, chunk=chunk, reference=reference, out_dir=out, progress=progress)
    rows = {}
    for label, result in results.items():
        row = result.summary()
        # Scored token i is predicted at position i: the first `model_window` are made within the window.
        row["ppl_in_window"] = result.ppl_between(0, model_window)
        row["ppl_past_window"] = result.ppl_between(model_window) if result.tokens > model_window else None
        rows[label] = row
    write_json(out / "results.json", rows)
    write_json(
        out / "meta.json",
        {
            "model": model_name,
            "text": text,
            "tokens": int(ids.numel()),
            "chunk": chunk,
            "model_window": model_window,
            "seconds": round(time.time() - started, 1),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "threads": torch.get_num_threads(),
        },
    )
    smooth = 256
    plot_lines(
        {label: running_mean(r.nll, smooth) for label, r in results.items()},
        out / "stream_nll.png",
        xlabel="token position in the stream",
        ylabel=f"NLL (log-perplexity), mean of {smooth} tokens",
        title=f"{model_name} on {Path(text).name}, chunk {chunk}",
        vline=model_window,
        vline_label="pretrained window",
    )
    return results
