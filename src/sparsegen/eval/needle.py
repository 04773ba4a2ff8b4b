"""What eviction forgets: passkey retrieval (a needle in a haystack) per policy, budget and depth.

A five-digit passkey sentence is hidden at a chosen depth of a long filler text (Shakespeare, from
a seeded offset). The context is read into a policy cache and compressed *before* the question
is asked: in one forward by default, after which the cache evicts down to its budget (kvpress's
protocol, the one prefill-compression methods are designed for), or in `chunk`-token pieces as a
stream. Only then are the question and the answer read and generated over what the policy kept,
so the answer cannot come from a dense look at the whole context. A trial counts as retrieved
when the greedy answer contains the passkey.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sparsegen.data import tokenize_long
from sparsegen.decode.reading import read
from sparsegen.ioutil import write_json
from sparsegen.kv.spec import KVSpec

NEEDLE = " The secret passkey is {key}. Remember it: the secret passkey is {key}. "
QUESTION = "\n\nWhat is the secret passkey? The secret passkey is"


@dataclass(frozen=True)
class NeedleCell:
    policy: str
    budget: int | None
    depth: float


def build_prompt(tokenizer, filler_ids: torch.Tensor, length: int, depth: float, key: str) -> tuple[list, list]:
    """(context ids, question ids): `length` filler tokens with the needle at `depth` (0 = start)."""
    needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    filler = filler_ids[: max(0, length - len(needle))].tolist()
    cut = int(round(depth * len(filler)))
    context = filler[:cut] + needle + filler[cut:]
    return context, tokenizer(QUESTION, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def retrieve(model, tokenizer, context: list[int], question: list[int], cache, chunk: int | None, answer_tokens=8):
    """Read `context` into `cache` (compressing it), then answer the question greedily through the
    one token loop, continuing that cache; return the answer's text."""
    from sparsegen.decode import generate

    read(model, context, cache, chunk)
    made = generate(model, [question], answer_tokens, cache.spec, compile="never", held=[cache])
    return tokenizer.decode(made.tokens[0], skip_special_tokens=True)


def _trials(tokenizer, filler: str, length: int, trials: int, seed: int) -> tuple[torch.Tensor, list, list]:
    """The filler's ids and each trial's seeded offset into it and passkey."""
    rng = random.Random(seed)
    filler_ids = tokenize_long(tokenizer, filler)
    offsets = [rng.randrange(0, filler_ids.numel() - length) for _ in range(trials)]
    keys = [f"{rng.randrange(10000, 100000)}" for _ in range(trials)]
    return filler_ids, offsets, keys


def accuracy(model, tokenizer, trials: tuple, kv: KVSpec, depth: float, length: int, chunk: int | None) -> float:
    """The share of `trials` (`_trials`) whose passkey at `depth` is retrieved under the KV spec `kv`."""
    from sparsegen.kv import make_cache

    filler_ids, offsets, keys = trials
    hits = 0
    for offset, key in zip(offsets, keys, strict=True):
        context, question = build_prompt(tokenizer, filler_ids[offset:], length, depth, key)
        hits += key in retrieve(model, tokenizer, context, question, make_cache(model, kv), chunk)
    return hits / len(keys)


def spec_accuracy(
    model, tokenizer, filler: str, kv: KVSpec, depths: list[float], length: int, trials: int, seed: int = 0
) -> float:
    """The mean accuracy over `depths` under one KV spec (a sweep's cell), the trials `needle_job`'s."""
    drawn = _trials(tokenizer, filler, length, trials, seed)
    return sum(accuracy(model, tokenizer, drawn, kv, depth, length, None) for depth in depths) / len(depths)


def needle_job(
    model,
    tokenizer,
    filler: str,
    policies: list[str],
    budgets: list[int],
    depths: list[float],
    length: int,
    trials: int,
    out: Path,
    chunk: int | None = None,
    seed: int = 0,
    progress: Callable[[str], None] = lambda message: None,
) -> list[dict]:
    """Accuracy per (policy, budget, depth), resuming from `out/needle.json`; `full` runs once."""
    path = out / "needle.json"
    settings = {"length": length, "trials": trials, "chunk": chunk, "seed": seed}
    saved = json.loads(path.read_text()) if path.exists() else {}
    rows = saved.get("rows", []) if saved.get("settings") == settings else []
    done = {(r["policy"], r["budget"], r["depth"]) for r in rows}
    drawn = _trials(tokenizer, filler, length, trials, seed)
    cells = [NeedleCell("full", None, d) for d in depths]
    cells += [NeedleCell(p, b, d) for p in policies if p != "full" for b in budgets for d in depths]
    for number, cell in enumerate(cells, 1):
        if (cell.policy, cell.budget, cell.depth) in done:
            continue
        progress(f"[{number}/{len(cells)}] {cell.policy} budget={cell.budget} depth={cell.depth:.2f}")
        share = accuracy(
            model, tokenizer, drawn, KVSpec.of(cell.policy, budget=cell.budget or None), cell.depth, length, chunk
        )
        rows.append({**asdict(cell), "accuracy": share, "trials": trials})
        write_json(path, {"settings": settings, "rows": rows})
    return rows


def plot_heatmap(rows: list[dict], depths: list[float], path: Path, title: str) -> None:
    """One row per policy and budget, one column per depth, accuracy as colour and number."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({(r["policy"], r["budget"] or 0) for r in rows}, key=lambda pb: (pb[1], pb[0]))
    grid = [
        [next(r["accuracy"] for r in rows if (r["policy"], r["budget"] or 0) == pb and r["depth"] == d) for d in depths]
        for pb in labels
    ]
    fig, ax = plt.subplots(figsize=(1.2 * len(depths) + 3, 0.45 * len(labels) + 1.5))
    image = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_yticks(range(len(labels)), [p if not b else f"{p} @ {b}" for p, b in labels])
    ax.set_xlabel("needle depth in the context")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="retrieval accuracy")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
