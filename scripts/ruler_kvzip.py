"""KVzip's settings side by side on the same RULER samples: each context read once (`SharedPrefill`)
and re-read once per distinct re-reading, every variant at each ratio and the full cache decoded
from it. Appends one JSON line per cell to OUT/records.jsonl and skips the samples already there
(resumable); the samples are `sparsegen eval ruler`'s (seed 42, kept in OUT/samples).

Usage: python scripts/ruler_kvzip.py MODEL LENGTH SAMPLES OUT NAME=SETTINGS [NAME=SETTINGS ...]
SETTINGS are kvzip's fields as key:value pairs joined by "," ("-" for none), e.g.
  pool=pool:model layer=pool:layer  (the twenty-ninth session's run)
  bare=- chunk=scope:chunk asked=scope:chunk,instructed:true
"""

import json
import sys
import time
from pathlib import Path

from sparsegen.decode import generate
from sparsegen.decode.kvzip_read import repeat_frame
from sparsegen.decode.shared import SharedPrefill
from sparsegen.eval.ruler import clean, kept_tokens
from sparsegen.eval.ruler_data import make_samples, task_table
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.loading import load

RATIOS = (0.75, 0.875, 0.9375)


def settings(text: str) -> dict:
    """ "key:value,key:value" as kvzip's settings (true/false as booleans)."""
    pairs = [] if text == "-" else [pair.split(":", 1) for pair in text.split(",")]
    return {key: {"true": True, "false": False}.get(value, value) for key, value in pairs}


def main(model_name: str, length: int, samples: int, out: Path, variants: dict[str, dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load(model_name)
    records = out / "records.jsonl"
    done = (
        {(r["task"], r["index"]) for r in map(json.loads, records.read_text().splitlines())}
        if records.exists()
        else set()
    )
    tasks = list(task_table())
    todo = [sample for task in tasks for sample in make_samples(tokenizer, task, length, samples, 42, out)]
    todo.sort(key=lambda sample: (sample.index, tasks.index(sample.task)))  # every task once, then again
    frame = repeat_frame(tokenizer)
    with policy_attention(model):
        for sample in (s for s in todo if (s.task, s.index) not in done):
            started = time.perf_counter()
            special = not getattr(tokenizer, "chat_template", None)
            context = tokenizer(sample.context, add_special_tokens=special)["input_ids"]
            question = tokenizer(sample.question, add_special_tokens=False)["input_ids"]
            shared = SharedPrefill(model, context, frame)
            cells = [("full", 0.0, KVSpec.of("full"))] + [
                (name, ratio, KVSpec.of("kvzip", budget=kept_tokens(len(context), ratio), **chosen))
                for name, chosen in variants.items()
                for ratio in RATIOS
            ]
            setting = task_table()[sample.task]
            made = generate(
                model,
                [question] * len(cells),
                setting["tokens_to_generate"],
                cells[1][2],
                compile="never",
                tokenizer=tokenizer,
                held=[shared.cache_for(kv) for *_, kv in cells],
                shared_context=shared,
            )
            seconds = time.perf_counter() - started
            with records.open("a") as file:
                for (name, ratio, _), tokens in zip(cells, made.tokens, strict=True):
                    prediction = tokenizer.decode(tokens, skip_special_tokens=True)
                    score = setting["metric"]([clean(prediction)], [sample.references])[0]
                    row = {"task": sample.task, "index": sample.index, "policy": name, "ratio": ratio}
                    file.write(json.dumps({**row, "score": score, "tokens": len(context), "seconds": seconds}) + "\n")
            print(f"{sample.task} #{sample.index}: {len(context)} tokens, {seconds:.0f} s", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    named = dict(variant.split("=", 1) for variant in sys.argv[5:])
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), {k: settings(v) for k, v in named.items()})
