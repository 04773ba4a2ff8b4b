"""The main job: compare KV policies on one long stream, past the model's pretrained window."""

from __future__ import annotations

import dataclasses
import platform
import time
from pathlib import Path

import torch

from sparsegen.data import load_text, tokenize_long
from sparsegen.errors import SparsegenError
from sparsegen.eval.stream_ppl import PolicyRun, StreamResult, stream_compare
from sparsegen.ioutil import write_json
from sparsegen.kv import POLICIES
from sparsegen.kv.policy import resolve_budget
from sparsegen.kv.quantized import checked_bits
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


def policy_runs(
    policies: list[str],
    budget: int | None,
    sinks: int | None,
    recent: int | None,
    heavy: int | None,
    position: str | None,
    model_window: int,
) -> list[PolicyRun]:
    """One PolicyRun per policy name, all at the same total: `budget`, else the sum of the parts
    given, split by each policy as the kv rule says (`resolve_budget`). `sinks` go to the
    policies that keep sinks: one comparison runs them beside policies that keep none."""
    total = budget if budget is not None else sum(part or 0 for part in (sinks, heavy, recent))
    if not total:
        raise SparsegenError("give --budget or --sinks/--recent/--heavy")
    conflicting = {} if budget is None else {"heavy": heavy, "recent": recent}  # refused beside a total
    runs = []
    for name in policies:
        if POLICIES.named(name).prefill_only:
            raise SparsegenError(
                f"{name} compresses a prompt once and then keeps every token, so it cannot bound a stream; "
                "compare it with `sparsegen eval needle` or `eval zeroshot`"
            )
        if name == "full":
            runs.append(
                PolicyRun(
                    "full", "full", max_tokens=model_window, note=f"stops at the model's {model_window}-token window"
                )
            )
            continue
        given = {**conflicting, "sinks": sinks if "sinks" in POLICIES[name].budget_parts() else None}
        runs.append(PolicyRun(name, name, position=position, budget=resolve_budget(name, None, total, given)))
    return runs


def stream_job(
    model_name: str,
    text: str,
    policies: list[str],
    tokens: int,
    chunk: int,
    out: Path,
    budget: int | None = None,
    sinks: int | None = None,
    recent: int | None = None,
    heavy: int | None = None,
    position: str | None = None,
    progress: bool = True,
    device: str | None = None,
    kv_bits: list[int] | tuple[int, ...] = (),
) -> dict[str, StreamResult]:
    """Run the comparison, write results.json, NLL files and the plot into `out`; return results.
    Each bit width in `kv_bits` adds a run of every bounded policy with its KV held in those bits."""
    model, tokenizer = load(model_name, device=device)
    model_window = model.config.get_text_config().max_position_embeddings
    if "full" not in policies:  # the reference for fidelity, always run within the model's window
        policies = ["full", *policies]
    runs = policy_runs(policies, budget, sinks, recent, heavy, position, model_window)
    runs += [
        dataclasses.replace(run, label=f"{run.label}-int{bits}", kv_bits=checked_bits(bits))
        for bits in kv_bits
        for run in runs
        if run.policy != "full"
    ]
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
