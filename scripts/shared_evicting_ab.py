"""Evicting rows over a 4k RULER context, decoding their own copies or reading the shared context
(`decode.context`), alternating in one process: decode seconds and whether the tokens agree
(docs/benchmarks.md, RULER section). Run it on a quiet machine.

    python scripts/shared_evicting_ab.py results/ruler-4k-now/samples/niah_multivalue-4096.json h2o tova window
"""

import sys
from pathlib import Path

from ruler_sample import load_sample

from sparsegen.decode import generate
from sparsegen.eval.ruler import DEFAULT_RATIOS, kept_tokens
from sparsegen.kv import make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.shared import SharedPrefill


def main(samples: Path, names: list[str]) -> None:
    model, _, context, question = load_sample(samples)
    with policy_attention(model):
        shared = SharedPrefill(model, context)
        for name in names:
            policies = [make_policy(name, budget=kept_tokens(len(context), r)) for r in DEFAULT_RATIOS]
            made = {}
            for round_ in range(2):
                for reads_shared in (True, False):
                    held = [shared.cache_for(p) for p in policies]
                    options = {"shared_context": shared} if reads_shared else {}
                    run = generate(model, [question] * 4, 128, policies[0], compile="never", held=held, **options)
                    made[reads_shared] = run.tokens
                    what = "shared context" if reads_shared else "own copies"
                    print(f"{name} {round_} {what}: {run.decode_s:.2f} s, {run.decode_steps} steps", flush=True)
            print(f"{name}: tokens equal: {made[True] == made[False]}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
