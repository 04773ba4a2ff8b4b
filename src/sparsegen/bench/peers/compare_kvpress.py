"""Cross-check sparsegen's KV policies against NVIDIA kvpress 0.5.5 on the same token ids: which
context positions each method keeps, per layer and KV head, and the RULER score of each answer.

kvpress pins transformers < 5.3, below what sparsegen needs, so its side runs in its own
environment (`kvpress_worker.py`, started by file path; it imports neither sparsegen nor its
dependencies beyond torch and transformers). The environment used:

    python3 -m venv /tmp/kvpvenv
    /tmp/kvpvenv/bin/pip install torch==2.13.0
    /tmp/kvpvenv/bin/pip install kvpress==0.5.5 "transformers>=5.2,<5.3"   # resolves to 5.2.0

    python -m sparsegen.bench.peers.compare_kvpress --kvpress-python /tmp/kvpvenv/bin/python \\
        --tasks niah_single_1,niah_single_2 --length 4096 --samples 1 --ratios 0.5,0.75 --out results/kvpress

Both sides read the same fp32 safetensors folder (transformers 5.2 reads its config as written by
5.24): the default model's, or `--model`'s (an embedded GGUF model's blocks dequantized once by
transformers, as `load(name, gguf_blocks=False)` reads them), and the same context and question
ids, tokenized as `eval.ruler.score_sample` does; kvpress compresses the context alone (its
query-agnostic protocol) and both decode greedily with the question at positions continuing from
the original context length. Both stop at sparsegen's `stop_tokens` (kvpress's pipeline would use
the generation config's EOS alone).

Expected differences, from the math of each side:
- streaming, knorm, keydiff: the same kept sets (knorm/keydiff up to float ties). Streaming's
  answers may differ: sparsegen's streaming defaults to rolling positions (the question is read
  at cache-relative positions), kvpress's keys and question keep their original positions.
- snapkv / pyramidkv: the same scores up to a scale (kvpress averages the window's attention over
  queries and the GQA group where sparsegen sums), pooled over the prompt before the window on both
  sides (the window is kept whole), so the same kept sets up to float near-ties at the budget's
  edge. PyramidKV's per-layer budgets are the same formula (kvpress keeps the unrounded budget
  where sparsegen rounds it down to a count: a layer may keep one token more or less).
  transformers 5.2 builds one SDPA mask from layer 0's length, so kvpress cannot read a
  multi-token question over PyramidKV's uneven layers; the worker reads it one token per forward.
- tova: kvpress averages the last query's attention over all query heads and gives every KV head
  that one score (every head keeps the same positions); sparsegen sums it over each KV head's GQA
  group, so each KV head keeps its own set.
- expected_attention, adakv (AdaKV over Expected Attention, alpha 0.2): the same statistics of the
  context's queries before RoPE (sinks left out), the same mean rotation over 512 future positions,
  the same safeguard (each head's top `max(1, int(0.2 * kept))`); kvpress hides AdaKV's dropped
  slots behind a mask where sparsegen frees them, so only the kept sets are compared.
- kvzip: both score a context token by the most attention its group pays it while the model
  re-reads its chunk (2048 tokens, the next chunk cued by the previous one's last 8), sinks kept,
  one pool for the whole model (kvpress's default `layerwise=False`; sparsegen rounds each layer's
  share to whole tokens per head, kvpress prunes any count), each query's attention renormalised
  over the sinks, the chunk and its copy (sparsegen's default `scope="chunk"`). kvpress asks the
  model to repeat the context before each re-read chunk, in the chat template's turn; sparsegen
  re-reads the bare tokens by default (`instructed=True` asks in its own words, other ids than
  kvpress's), and its chunks start at the context's first token where kvpress's start after the
  chat template's opening. So the kept sets overlap without being identical, and the RULER scores
  are what is compared.
- Not compared: DuoAttention (kvpress downloads its head patterns from the Hub, offline here; and
  sparsegen calibrates its own).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("kvpress_worker.py")
PRESSES = ("streaming", "snapkv", "tova", "knorm", "keydiff", "pyramidkv", "expected_attention", "adakv", "kvzip")
WINDOW = 64  # kvpress's SnapKV / PyramidKV observation window, mirrored on sparsegen's side
KERNEL = 5


def make_inputs(tokenizer, tasks: list[str], length: int, samples: int, seed: int, work: Path) -> list[dict]:
    """RULER samples as token ids, tokenized exactly as `eval.ruler.score_sample` does."""
    from sparsegen.eval.ruler_data import make_samples, task_table

    table = task_table()
    made = []
    for task in tasks:
        for sample in make_samples(tokenizer, task, length, samples, seed, work):
            special = not getattr(tokenizer, "chat_template", None)
            made.append(
                {
                    "id": f"{task}-{sample.length}-{sample.index}",
                    "task": task,
                    "references": list(sample.references),
                    "context_ids": tokenizer(sample.context, add_special_tokens=special)["input_ids"],
                    "question_ids": tokenizer(sample.question, add_special_tokens=False)["input_ids"],
                    "max_new_tokens": table[task]["tokens_to_generate"],
                }
            )
    return made


def run_worker(python: str, job: dict, work: Path) -> dict:
    """kvpress's side, in kvpress's environment; its input and output stay in `work` for reruns."""
    from sparsegen.ioutil import write_json

    given, made = work / "kvpress_input.json", work / "kvpress_output.json"
    write_json(given, job)
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([python, str(WORKER), str(given), str(made)], check=True, env=env)
    return json.loads(made.read_text())


def make_press_policy(name: str, kept: int):
    """sparsegen's policy with the settings of kvpress's press of the same name, keeping `kept`."""
    from sparsegen.kv import make_policy

    settings = {
        "streaming": {"sinks": 4, "recent": kept - 4},
        "snapkv": {"heavy": kept - WINDOW, "recent": WINDOW, "kernel": KERNEL},
        "tova": {"heavy": kept},
        "knorm": {"heavy": kept},
        "keydiff": {"heavy": kept},
        "pyramidkv": {"heavy": kept - WINDOW, "recent": WINDOW, "beta": 20.0},
        "expected_attention": {"sinks": 4, "heavy": kept - 4},
        "adakv": {"sinks": 4, "heavy": kept - 4, "alpha": 0.2},
        "kvzip": {"sinks": 4, "heavy": kept - 4},
    }
    return make_policy(name, **settings[name])


def sparsegen_side(model, sample: dict, cells: list[tuple[str, float]], stops: list[int]) -> dict:
    """For each (press, ratio): sparsegen's kept positions per layer and KV head, and its answer."""
    from sparsegen.decode import generate
    from sparsegen.decode.shared import SharedPrefill
    from sparsegen.eval.ruler import kept_tokens

    context = sample["context_ids"]
    shared = SharedPrefill(model, context)
    made = {}
    for name, ratio in cells:
        policy = make_press_policy(name, kept_tokens(len(context), ratio))
        cache = shared.cache_for(policy)
        kept = [layer.kept_positions()[0] for layer in cache.policy_layers()]
        limit = sample["max_new_tokens"]
        answer = generate(
            model, [sample["question_ids"]], limit, policy, compile="never", eos_token_id=stops, held=[cache]
        )
        made[(name, ratio)] = {"kept": kept, "tokens": [int(t) for t in answer.tokens[0]]}
    return made


def overlap(ours: list[list[list[int]]], theirs: list[list[list[int]]]) -> dict:
    """Agreement of two kept-position sets per (layer, head): share identical, mean Jaccard, and
    each layer's mean Jaccard and mean kept count on both sides (to see where they part)."""
    identical, jaccards, layers = 0, [], []
    for our_layer, their_layer in zip(ours, theirs, strict=True):
        row = []
        for our_head, their_head in zip(our_layer, their_layer, strict=True):
            a, b = set(our_head), set(their_head)
            identical += a == b
            row.append(len(a & b) / max(1, len(a | b)))
        jaccards += row
        layers.append(
            {
                "jaccard": sum(row) / len(row),
                "kept_sparsegen": sum(map(len, our_layer)) / len(our_layer),
                "kept_kvpress": sum(map(len, their_layer)) / len(their_layer),
            }
        )
    return {"identical": identical / len(jaccards), "jaccard": sum(jaccards) / len(jaccards), "layers": layers}


def score(tokenizer, task: str, tokens: list[int] | None, references: list[str]) -> tuple[str, float | None]:
    """An answer's text and RULER score, as `eval.ruler.score_sample` scores it."""
    from sparsegen.eval.ruler import clean
    from sparsegen.eval.ruler_data import task_table

    if tokens is None:
        return "", None
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    return text, task_table()[task]["metric"]([clean(text)], [references])[0]


def compare_sample(tokenizer, sample: dict, ours: dict, theirs: dict) -> list[dict]:
    """One record per (press, ratio) of one sample, joining both sides."""
    from sparsegen.eval.ruler import clean

    rows = []
    for (name, ratio), mine in ours.items():
        other = theirs.get((sample["id"], name, ratio))
        row = {"id": sample["id"], "task": sample["task"], "press": name, "ratio": ratio}
        row["context_tokens"] = len(sample["context_ids"])
        our_text, our_score = score(tokenizer, sample["task"], mine["tokens"], sample["references"])
        row |= {"sparsegen_answer": our_text, "sparsegen_score": our_score}
        if other is None:
            rows.append(row | {"error": "kvpress produced no result"})
            continue
        their_text, their_score = score(tokenizer, sample["task"], other["tokens"], sample["references"])
        row |= {"kvpress_answer": their_text, "kvpress_score": their_score}
        row |= {"same_answer": clean(our_text) == clean(their_text), "question_read": other.get("question_read")}
        rows.append(row | overlap(mine["kept"], other["kept"]))
    return rows


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _cell(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows: list[dict]) -> str:
    """Markdown table, one line per (press, ratio), averaged over samples."""
    head = ["press", "ratio", "samples", "identical (layer,head)", "mean Jaccard"]
    head += ["sparsegen score", "kvpress score", "same answer"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    keys = sorted({(r["press"], r["ratio"]) for r in rows}, key=lambda k: (PRESSES.index(k[0]), k[1]))
    for name, ratio in keys:
        group = [r for r in rows if (r["press"], r["ratio"]) == (name, ratio)]
        cells = [_mean([r.get(k) for r in group]) for k in ("identical", "jaccard", "sparsegen_score")]
        cells += [_mean([r.get(k) for r in group]) for k in ("kvpress_score", "same_answer")]
        lines.append(f"| {name} | {ratio:g} | {len(group)} | " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kvpress-python", required=True, help="python of an environment with kvpress 0.5.5")
    parser.add_argument("--model", default=None, help="an embedded name or a transformers folder (default model)")
    parser.add_argument("--tasks", default="niah_single_1,niah_single_2")
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--ratios", default="0.5,0.75")
    parser.add_argument("--presses", default=",".join(PRESSES))
    parser.add_argument("--out", type=Path, default=Path("results/kvpress"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    """Build the samples, run kvpress's side, then sparsegen's on the same ids, and compare."""
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.loading import DEFAULT_MODEL, load, resolve_model_path
    from sparsegen.sampling import stop_tokens

    args = parse_args(argv)
    presses = [p for p in args.presses.split(",") if p]
    unknown = sorted(set(presses) - set(PRESSES))
    if unknown:
        raise SystemExit(f"unknown press(es) {unknown}; known: {', '.join(PRESSES)}")
    cells = [(p, float(r)) for p in presses for r in args.ratios.split(",")]
    torch.set_grad_enabled(False)
    # both sides read the same fp32 safetensors folder (a GGUF model's blocks dequantized once)
    model_dir = resolve_model_path(args.model or DEFAULT_MODEL, gguf_blocks=False)
    model, tokenizer = load(model_dir, dtype=torch.float32)
    stops = sorted(stop_tokens(model, tokenizer))
    samples = make_inputs(tokenizer, args.tasks.split(","), args.length, args.samples, args.seed, args.out)
    job = {
        "model_dir": model_dir,
        "samples": [{k: s[k] for k in ("id", "context_ids", "question_ids", "max_new_tokens")} for s in samples],
        "presses": [{"name": p, "ratio": r} for p, r in cells],
        "eos_ids": stops,
    }
    made = run_worker(args.kvpress_python, job, args.out)
    theirs = {(r["id"], r["press"], r["ratio"]): r for r in made["results"]}
    rows = []
    for sample in samples:
        rows += compare_sample(tokenizer, sample, sparsegen_side(model, sample, cells, stops), theirs)
        print(f"sparsegen {sample['id']} done", file=sys.stderr, flush=True)
    markdown = table(rows)
    failures = made["failures"]
    if failures:
        markdown += "\nkvpress failures:\n" + "".join(f"- {f['press']} {f['ratio']}: {f['error']}\n" for f in failures)
    write_json(args.out / "compare.json", {"versions": made["versions"], "rows": rows, "failures": failures})
    write_text(args.out / "compare.md", markdown)
    print(markdown)


if __name__ == "__main__":
    main()
