"""Where one RULER sample's time goes: the shared read, each policy's choice from it, and each
decode group's question reading (`prefill`) and steps (docs/benchmarks.md, RULER section). Reads
the samples a `sparsegen eval ruler` run kept in OUT/samples. Run it on a quiet machine.

    python scripts/ruler_sample_parts.py results/ruler-4k-now niah_single_1
"""

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import sparsegen.decode
import sparsegen.kv.shared
from sparsegen.cli.common import METHODS
from sparsegen.eval.ruler import RulerSettings, score_sample
from sparsegen.eval.ruler_data import RulerSample
from sparsegen.kv.attention import policy_attention
from sparsegen.loading import load


def main(out: Path, task: str) -> None:
    model, tokenizer = load("smollm2-135m")
    saved = json.loads((out / "samples" / f"{task}-4096.json").read_text())
    sample = RulerSample(**saved["samples"][0])
    settings = RulerSettings("smollm2-135m", (task,), (4096,), 1, tuple(METHODS["policies"]))
    generate, cache_for, shared_init = (
        sparsegen.decode.generate,
        sparsegen.kv.shared.SharedPrefill.cache_for,
        sparsegen.kv.shared.SharedPrefill.__init__,
    )
    choices: dict[str, float] = defaultdict(float)

    def timed_generate(model, prompts, steps, policy, **options):
        made = generate(model, prompts, steps, policy, **options)
        print(
            f"  {policy.name:20} rows {len(prompts):2} steps {made.decode_steps:3} "
            f"prefill {made.prefill_s:6.2f} s decode {made.decode_s:6.2f} s"
        )
        return made

    def timed_cache_for(self, policy, **options):
        started = time.perf_counter()
        cache = cache_for(self, policy, **options)
        choices[policy.name] += time.perf_counter() - started
        return cache

    def timed_init(self, model, ids):
        started = time.perf_counter()
        shared_init(self, model, ids)
        print(f"  shared read {time.perf_counter() - started:.2f} s")

    sparsegen.decode.generate = timed_generate
    sparsegen.kv.shared.SharedPrefill.cache_for = timed_cache_for
    sparsegen.kv.shared.SharedPrefill.__init__ = timed_init
    started = time.perf_counter()
    with policy_attention(model):
        score_sample(model, tokenizer, sample, settings)
    print("  choices:", {name: round(seconds, 2) for name, seconds in choices.items()})
    print(f"{task}: {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
