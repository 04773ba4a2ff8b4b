"""RULER accuracy per KV policy and compression ratio, as kvpress's leaderboard measures it.

Each sample's context is read once (`decode.shared.SharedPrefill`); every policy x ratio then gets the
cache it would have made reading that context itself, and the question and answer are decoded
over what it kept (a row per cell, one batch for every cell that reads the context's keys
shared, `decode.context`). A compression ratio is the share of the tokens read before the
question that is evicted (kvpress's `compression_ratio`): the policy's budget is the rest, at
least one token. Protocols: `query-agnostic` compresses the context before the question is read
(kvpress's leaderboard); `query-aware` reads the question with the context, then compresses.
Scores are RULER's own metrics, on predictions cleaned as RULER does.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from sparsegen.errors import SparsegenError
from sparsegen.eval.ruler_data import RulerSample, make_samples, task_table
from sparsegen.ioutil import write_json
from sparsegen.kv.quantized import checked_bits
from sparsegen.kv.spec import KVSpec

PROTOCOLS = ("query-agnostic", "query-aware")
DEFAULT_RATIOS = (0.25, 0.5, 0.75, 0.875)
_CONTROL = re.compile(r"[\x00-\x1f]")


@dataclass(frozen=True)
class RulerSettings:
    """What a run measures: a second run with the same settings resumes the first."""

    model: str
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    samples: int
    policies: tuple[str, ...]
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    protocol: str = "query-agnostic"
    seed: int = 42
    haystack: str | None = None
    separate_prefill: bool = False
    """Run every policy x ratio alone, reading the context again (to check and time the shared run)."""
    duo_heads: str | None = None
    """duo_attention's calibrated retrieval heads (a JSON file); None scores heads on each prompt."""
    kv_bits: int | None = None
    """Every cell's keys and values held in this many bits (`kv.quantized`); None: full precision."""

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise SparsegenError(f"--protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not all(0 < ratio < 1 for ratio in self.ratios):
            raise SparsegenError(f"compression ratios must be in (0, 1), got {list(self.ratios)}")
        if self.samples < 1:
            raise SparsegenError(f"--samples must be >= 1, got {self.samples}")
        checked_bits(self.kv_bits)

    @classmethod
    def saved_as(cls, saved: dict) -> dict:
        """Settings as a results file keeps them (JSON: lists), a file written before a setting
        existed holding its default."""
        defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
        return json.loads(json.dumps({**defaults, **saved}))


def kept_tokens(read: int, ratio: float) -> int:
    """The budget of a policy evicting `ratio` of `read` tokens (kvpress's n_kept)."""
    return max(1, int(read * (1 - ratio)))


def clean(prediction: str) -> str:
    """A prediction as RULER scores it: stripped, control characters turned into line breaks."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def _cells(settings: RulerSettings) -> list[tuple[str, float]]:
    return [("full", 0.0)] + [(p, r) for p in settings.policies if p != "full" for r in settings.ratios]


def _read_alone(model, context: list[int], kv: KVSpec, frame):
    from sparsegen.decode.reading import read
    from sparsegen.kv import make_cache

    cache = make_cache(model, kv.resolved(len(context)))
    read(model, context, cache, frame=frame)
    return cache


def _decode_groups(cells: list[tuple[str, float]], context_length: int, settings: RulerSettings) -> list[list[dict]]:
    """The cells as rows of shared decodes: every cell that can read the shared context (full
    precision, keys at original positions or rolling only the sinks: `decode.context`) in one
    batch, each row evicting by its own policy; another at rolling positions in its own (its
    ratios as rows). Held in `kv_bits`, the cells that keep each new token share one batch
    (decoding consults no policy), each evicting policy the cells whose specs share a step
    (`KVSpec.step_key`). Separate runs (`separate_prefill`) decode every cell alone, as a run per
    cell would."""
    from sparsegen.decode.handover import reads_shared_context

    groups: dict[object, list[dict]] = defaultdict(list)
    for name, ratio in cells:
        budget = kept_tokens(context_length, ratio) if ratio else None
        extra = {"heads": settings.duo_heads} if name == "duo_attention" and settings.duo_heads else {}
        kv = KVSpec.of(name, budget=budget, kv_bits=settings.kv_bits, **extra)
        keeps_new = name == "full" or type(kv.policy).prefill_only
        reads_context = reads_shared_context(
            kv.policy, rolled=kv.placement != "original", quantized=kv.kv_bits is not None
        )
        key = "keeps every new token" if keeps_new else kv.step_key()
        key = (name, ratio) if settings.separate_prefill else "reads the context" if reads_context else key
        groups[key].append({"name": name, "ratio": ratio, "budget": budget, "kv": kv})
    return list(groups.values())


def score_sample(model, tokenizer, sample: RulerSample, settings: RulerSettings) -> list[dict]:
    """Every policy x ratio on one sample, from one prefill of its context."""
    from sparsegen.decode import generate
    from sparsegen.decode.kvzip_read import repeat_frame
    from sparsegen.decode.shared import SharedPrefill

    context = tokenizer(sample.context, add_special_tokens=not getattr(tokenizer, "chat_template", None))["input_ids"]
    question = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
    if settings.protocol == "query-aware":
        context, question = context + question[:-1], question[-1:]
    setting = task_table()[sample.task]
    started = time.perf_counter()
    frame = repeat_frame(tokenizer)  # for a policy that asks the model to repeat the context (kvzip)
    shared = None if settings.separate_prefill else SharedPrefill(model, context, frame)
    prefill_s = time.perf_counter() - started
    records = []
    for group in _decode_groups(_cells(settings), len(context), settings):
        began = time.perf_counter()
        caches = [
            _read_alone(model, context, cell["kv"], frame) if shared is None else shared.cache_for(cell["kv"])
            for cell in group
        ]
        made = generate(
            model,
            [question] * len(group),
            setting["tokens_to_generate"],
            group[0]["kv"],
            compile="never",
            tokenizer=tokenizer,
            held=caches,
            shared_context=shared,
        )
        seconds = time.perf_counter() - began
        for cell, tokens in zip(group, made.tokens, strict=True):
            prediction = tokenizer.decode(tokens, skip_special_tokens=True)
            score = setting["metric"]([clean(prediction)], [sample.references])[0]
            records.append(
                {
                    "task": sample.task,
                    "length": sample.length,
                    "index": sample.index,
                    "policy": cell["name"],
                    "ratio": cell["ratio"],
                    "budget": cell["budget"],
                    "setting": cell["kv"].policy.describe(),
                    "kv": cell["kv"].to_dict(),
                    "protocol": settings.protocol,
                    "kv_bits": settings.kv_bits,
                    "context_tokens": len(context),
                    "prediction": prediction,
                    "score": score,
                    "decode_s": seconds / len(group),
                    "prefill_s": prefill_s,
                }
            )
    return records


def ruler_job(model, tokenizer, settings: RulerSettings, out: Path, progress: bool = True) -> list[dict]:
    """Score every sample of every task and length, resuming from `out/results.json` (written
    atomically after each sample): `samples` holds each sample's prompt and references, `records`
    each (sample, policy, ratio)'s prediction and score."""
    from tqdm.auto import tqdm

    from sparsegen.kv.attention import policy_attention

    path = out / "results.json"
    saved = json.loads(path.read_text()) if path.exists() else {}
    if RulerSettings.saved_as(saved.get("settings", {})) != RulerSettings.saved_as(asdict(settings)):
        saved = {}
    records, prompts = saved.get("records", []), saved.get("samples", [])
    done = {(r["task"], r["length"], r["index"]) for r in records}
    haystack = Path(settings.haystack) if settings.haystack else None
    samples = []
    pairs = [(task, length) for length in settings.lengths for task in settings.tasks]
    for task, length in tqdm(pairs, desc="RULER's generators", unit="task", disable=not progress):
        samples += make_samples(tokenizer, task, length, settings.samples, settings.seed, out, haystack)
    todo = [s for s in samples if (s.task, s.length, s.index) not in done]
    cells = len(_cells(settings))
    bar = tqdm(total=len(samples), initial=len(samples) - len(todo), unit="sample", disable=not progress)
    with bar, policy_attention(model):  # the model's own attention again when the job ends
        for sample in todo:
            bar.set_description(f"{sample.task} @ {sample.length} ({cells} cells)")
            started = time.perf_counter()
            records += score_sample(model, tokenizer, sample, settings)
            prompts.append(
                {
                    "task": sample.task,
                    "length": sample.length,
                    "index": sample.index,
                    "prompt": sample.context + sample.question,
                    "references": sample.references,
                    "seconds": time.perf_counter() - started,
                }
            )
            write_json(path, {"settings": asdict(settings), "samples": prompts, "records": records})
            bar.update()
    return records


def summary(records: list[dict]) -> dict[int, list[dict]]:
    """Per length, one row per (policy, ratio): the mean score per task and over tasks."""
    scores: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        scores[(r["length"], r["policy"], r["ratio"], r["task"])].append(r["score"])
    tables: dict[int, dict[tuple, dict]] = defaultdict(dict)
    for (length, policy, ratio, task), values in scores.items():
        row = tables[length].setdefault((policy, ratio), {"policy": policy, "ratio": ratio})
        row[task] = sum(values) / len(values)
    out = {}
    for length, rows in sorted(tables.items()):
        for row in rows.values():
            tasks = [v for k, v in row.items() if k not in ("policy", "ratio")]
            row["average"] = sum(tasks) / len(tasks)
        out[length] = sorted(rows.values(), key=lambda row: (row["policy"] != "full", row["policy"], row["ratio"]))
    return out


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Average score against compression ratio, one line per policy, the full cache as a level line."""
    from sparsegen.report import plot_lines

    ratios = sorted({row["ratio"] for row in rows if row["policy"] != "full"})
    full = next((row["average"] for row in rows if row["policy"] == "full"), None)
    series = {}
    for policy in dict.fromkeys(row["policy"] for row in rows if row["policy"] != "full"):
        points = sorted((row["ratio"], row["average"]) for row in rows if row["policy"] == policy)
        series[policy] = ([x for x, _ in points], [y for _, y in points])
    if full is not None and ratios:
        series["full cache"] = (ratios, [full] * len(ratios))
    plot_lines(series, path, "compression ratio (share of the context evicted)", "RULER score (average)", title)
