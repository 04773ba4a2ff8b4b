"""A 4-row Streaming-H2O decode step over a 4k RULER context (ratios 0.25-0.875), with the keys
rotated inside the C++ product (`rolled_scores`) and rotated in torch, alternating in one process
(docs/benchmarks.md, RULER section). Run it on a quiet machine.

    python scripts/rolled_scores_ab.py results/ruler-4k-now/samples/niah_multivalue-4096.json
"""

import sys
import time
from pathlib import Path

from ruler_sample import load_sample

from sparsegen.decode import Decoder
from sparsegen.kv import make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.shared import SharedPrefill


def main(samples: Path) -> None:
    model, _, context, question = load_sample(samples)
    with policy_attention(model):
        shared = SharedPrefill(model, context)
        policies = [make_policy("streaming_h2o", budget=int(len(context) * (1 - r))) for r in (0.25, 0.5, 0.75, 0.875)]
        decoder = Decoder(model, policies[0], compile="never")
        caches, logits = decoder.prefill([question] * 4, [shared.cache_for(p) for p in policies])
        decoder.start_from(caches, 200)
        token = logits.argmax(-1)
        for _ in range(3):
            token = decoder.step(token).argmax(-1)
        for round_ in range(3):
            for fused in (True, False):
                for layer in decoder.state.layers:
                    layer.rolled_products = fused
                started = time.perf_counter()
                for _ in range(15):
                    token = decoder.step(token).argmax(-1)
                what = "rolled kernel" if fused else "torch rotation"
                print(f"{round_} {what}: {(time.perf_counter() - started) / 15 * 1000:.1f} ms/step", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
