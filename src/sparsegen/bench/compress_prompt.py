"""`sparsegen bench compress-prompt`: Compress-Then-Prompt's tables on this project's models, in one run.

Each compressed variant is built from the dense model (pruning and quantization calibrated on the
training part of the training text). One soft prompt is learned on one variant and the training
text; every variant is then evaluated without and with that prompt on held-out text: the last
tenth of the training text (never sampled for training) and another text (transfer across texts),
and optionally the zero-shot tasks (transfer across tasks). Results are kept per row in
`results.json`; a rerun skips what is done, and the prompt's training resumes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta


@dataclass(frozen=True)
class Variant:
    """One compression: Wanda pruning (sparsity or N:M) then RTN/GPTQ quantization, either optional."""

    name: str
    sparsity: float = 0.0
    pattern: str | None = None
    bits: int = 0
    method: str = "rtn"

    def build(self, model, calibration, group_size: int):
        from sparsegen.prune import prune
        from sparsegen.quant import QuantScheme, quantize

        if self.sparsity or self.pattern:
            prune(model, "wanda", self.sparsity, self.pattern, calibration=calibration, progress=False)
        if self.bits:
            quantize(model, self.method, self.bits, group_size, calibration=calibration, progress=False)
            return QuantScheme(self.bits, group_size)
        return None


VARIANTS = [
    Variant("dense"),
    Variant("int4 (RTN)", bits=4),
    Variant("int4 (GPTQ)", bits=4, method="gptq"),
    Variant("2:4 + int8", pattern="2:4", bits=8),
    Variant("50% + int4", sparsity=0.5, bits=4),
]
PROMPT_VARIANT = "50% + int4"


def bench_compress_prompt(
    model_name: str = "smollm2-135m",
    train_text: str = "shakespeare",
    other_text: str = "milton",
    prompt_variant: str = PROMPT_VARIANT,
    steps: int = 200,
    tokens: int = 100,
    lr: float = 1e-3,
    seqlen: int = 1024,
    n_train: int = 400,
    eval_windows: int = 16,
    group_size: int = 128,
    calib_samples: int = 32,
    calib_seqlen: int = 512,
    zeroshot_limit: int | None = 60,
    zeroshot_variants: tuple[str, ...] = ("dense", PROMPT_VARIANT),
    out: Path = Path("results/bench_compress_prompt"),
    progress: Callable[[str], None] = print,
    device: str | None = None,
) -> list[dict]:
    from sparsegen.data import calibration_samples
    from sparsegen.errors import SparsegenError
    from sparsegen.loading import load
    from sparsegen.prompt import PromptTraining

    names = [v.name for v in VARIANTS]
    if prompt_variant not in names:
        raise SparsegenError(f"unknown variant {prompt_variant!r}; choose one of: {', '.join(names)}")
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict[str, dict] = json.loads(results_path.read_text()) if results_path.exists() else {}
    dense, tokenizer = load(model_name, device=device)
    training_part, texts = _split_texts(tokenizer, train_text, other_text)
    calibration = calibration_samples(tokenizer, training_part, calib_samples, calib_seqlen, seed=0)
    prompt_dir = out / "prompt"
    settings = PromptTraining(tokens=tokens, steps=steps, lr=lr)
    data = _PromptData(tokenizer, training_part, n_train, seqlen)
    prompt = None
    order = sorted(VARIANTS, key=lambda v: v.name != prompt_variant)  # the prompt's own variant first
    for variant in order:
        row = results.get(variant.name, {})
        model = None
        if prompt is None or "ppl" not in row or (variant.name in zeroshot_variants and "zeroshot" not in row):
            model = _built(variant, model_name, device, calibration, group_size, row, progress)
        if prompt is None:
            prompt = _soft_prompt(model, model_name, data, settings, prompt_dir, variant.name, row, progress)
        if "ppl" not in row:
            row["ppl"] = _perplexities(model, prompt, texts, seqlen, eval_windows, variant.name, progress)
            _record(results, results_path, variant.name, row)
        if variant.name in zeroshot_variants and zeroshot_limit != 0 and "zeroshot" not in row:
            row["zeroshot"] = _zeroshot(model, tokenizer, prompt, variant, zeroshot_limit, out, progress)
            _record(results, results_path, variant.name, row)
    rows = _rows(results, names, texts, dense_name="dense")
    meta = run_meta(seconds=round(time.perf_counter() - started, 1))
    write_json(out / "bench_compress_prompt.json", {"meta": meta, "rows": rows})
    calibrated = f"{calib_samples} x {calib_seqlen}"
    header = _header(meta, model_name, settings, data, train_text, prompt_variant, calibrated, eval_windows, group_size)
    write_text(out / "bench_compress_prompt.md", header + markdown_table(rows, _columns(texts, rows)))
    return rows


def _built(variant: Variant, model_name: str, device, calibration, group_size: int, row: dict, progress) -> object:
    """A fresh copy of the model compressed as `variant`; its bits per weight put in its `row`."""
    from sparsegen.loading import load
    from sparsegen.quant.size import bits_per_weight

    progress(f"{variant.name}: building")
    model, _ = load(model_name, device=device)
    scheme = variant.build(model, calibration, group_size)
    size = bits_per_weight(model, scheme)
    row.update(variant=variant.name, bits=size.stored, sparse_bits=size.sparse_packed if scheme else None)
    return model


@dataclass(frozen=True)
class _PromptData:
    """Where the soft prompt's training samples come from: `n_train` windows of `seqlen` tokens of
    the training part (drawn only if the prompt is trained)."""

    tokenizer: object
    training_part: str
    n_train: int
    seqlen: int


def _soft_prompt(model, model_name: str, data: _PromptData, settings, prompt_dir: Path, variant: str, row, progress):
    """The one soft prompt: loaded from `prompt_dir` when its training there ran every step, else
    trained (resuming) on `variant`'s model, its training seconds put in that variant's `row`."""
    from sparsegen.data import calibration_samples
    from sparsegen.prompt import SoftPrompt, train_prompt

    if (prompt_dir / "adapter_model.safetensors").exists() and _trained_steps(prompt_dir) == settings.steps:
        return SoftPrompt.load(prompt_dir, model)
    progress(f"training the soft prompt on {variant} ({settings.steps} steps)")
    samples = calibration_samples(data.tokenizer, data.training_part, data.n_train, data.seqlen, seed=1)
    prompt, report = train_prompt(model, samples, prompt_dir, settings, base_model=model_name)
    row["train_seconds"] = report.seconds
    return prompt


def _record(results: dict, path: Path, name: str, row: dict) -> None:
    """Keep a variant's row as soon as a measure is added to it, so that a rerun skips it."""
    results[name] = row
    write_json(path, results)


def _header(
    meta: dict,
    model_name: str,
    settings,
    data: _PromptData,
    train_text: str,
    prompt_variant: str,
    calibrated: str,
    eval_windows: int,
    group_size: int,
) -> str:
    """The markdown table's opening line: what the prompt was trained on and how, the compression's
    calibration, the perplexity windows, the group size and the machine."""
    n_train, seqlen = data.n_train, data.seqlen
    return (
        f"model `{model_name}`; prompt: {settings.tokens} virtual tokens, {settings.steps} steps, AdamW lr "
        f"{settings.lr}, {n_train} samples x "
        f"{seqlen} of the first 90% of `{train_text}`, trained on `{prompt_variant}`; compression calibrated on "
        f"{calibrated} of the same part; perplexity over the first {eval_windows} windows of "
        f"{seqlen} tokens; "
        f"group size {group_size} (or the largest divisor of a row below it); "
        f"{meta['machine']}, {meta['date']}\n\n"
    )


def _split_texts(tokenizer, train_text: str, other_text: str) -> tuple[str, dict]:
    """The training part of `train_text` (its first 90%), and the held-out token ids by label: its
    last tenth (never sampled for training) and all of `other_text` (transfer across texts)."""
    from sparsegen.data import load_text, tokenize_long

    text = load_text(train_text)
    cut = int(len(text) * 0.9)
    held_out = {
        f"{train_text} (last 10%)": tokenize_long(tokenizer, text[cut:]),
        other_text: tokenize_long(tokenizer, load_text(other_text)),
    }
    return text[:cut], held_out


def _perplexities(
    model, prompt, texts: dict, seqlen: int, windows: int, variant: str, progress: Callable[[str], None]
) -> dict[str, dict[str, float]]:
    """Perplexity on each held-out text, without and with the soft prompt."""
    from sparsegen.eval.perplexity import prompted_ppl

    ppl = {}
    for label, ids in texts.items():
        progress(f"{variant}: perplexity on {label}")
        ppl[label] = {
            "plain": prompted_ppl(model, None, ids, seqlen, windows).ppl,
            "prompted": prompted_ppl(model, prompt, ids, seqlen, windows).ppl,
        }
    return ppl


def _trained_steps(folder: Path) -> int:
    path = folder / "training.json"
    return len(json.loads(path.read_text())["losses"]) if path.exists() else 0


def _zeroshot(model, tokenizer, prompt, variant, limit, out, progress) -> dict:
    from sparsegen.eval.harness import SparsegenLM
    from sparsegen.eval.tasks import TASKS
    from sparsegen.eval.zeroshot import zeroshot_job

    scores = {}
    slug = variant.name.replace(" ", "").replace("%", "pct").replace(":", "of").replace("+", "-")
    for label, soft in (("plain", None), ("prompted", prompt)):
        progress(f"{variant.name}: zero-shot {label}")
        lm = SparsegenLM(loaded=(model, tokenizer), batch_size=8, soft_prompt=soft)
        summary = zeroshot_job(lm, list(TASKS), out / "zeroshot" / f"{slug}-{label}", limit, {"variant": variant.name})
        scores[label] = summary["mean_acc"]
    return scores


def _rows(results: dict, names: list[str], texts: dict, dense_name: str) -> list[dict]:
    rows = []
    dense = results.get(dense_name, {}).get("ppl", {})
    for name in names:
        if name not in results:
            continue
        row = results[name]
        flat = {"variant": name, "bits": row["bits"], "sparse_bits": row["sparse_bits"]}
        for label in texts:
            plain, prompted = row["ppl"][label]["plain"], row["ppl"][label]["prompted"]
            flat[f"{label} plain"] = plain
            flat[f"{label} prompted"] = prompted
            base = dense.get(label, {}).get("plain")
            if base is not None and plain > base * 1.001:
                flat[f"{label} recovered"] = (plain - prompted) / (plain - base)
        if "zeroshot" in row:
            flat["zero-shot plain"] = row["zeroshot"]["plain"]
            flat["zero-shot prompted"] = row["zeroshot"]["prompted"]
        rows.append(flat)
    return rows


def _columns(texts: dict, rows: list[dict]) -> list[tuple[str, str]]:
    columns = [("variant", "variant"), ("bits", "bits/weight stored"), ("sparse_bits", "bits/weight with bitmask")]
    for label in texts:
        columns += [(f"{label} {kind}", f"ppl {label} {kind}") for kind in ("plain", "prompted", "recovered")]
    if any("zero-shot plain" in row for row in rows):
        columns += [("zero-shot plain", "zero-shot mean plain"), ("zero-shot prompted", "zero-shot mean prompted")]
    return columns
