"""How long KVzip's re-reading of one RULER context takes (`kv.kvzip.reconstruct`, 3 runs), for
an A/B against another commit run through `PYTHONPATH=<its src>` (docs/benchmarks.md, RULER
section). Run it on a quiet machine.

    python scripts/kvzip_reread_time.py results/ruler-4k-now/samples/niah_multivalue-4096.json
"""

import sys
import time
from pathlib import Path

from ruler_sample import load_sample

from sparsegen.kv import kvzip, make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.shared import SharedPrefill


def main(samples: Path) -> None:
    print("code:", kvzip.__file__)
    model, _, context, _ = load_sample(samples)
    with policy_attention(model):
        shared = SharedPrefill(model, context)
        probes = tuple(make_policy("kvzip", budget=0.5).resolved(len(context)).probes(len(context)))
        for _ in range(3):
            started = time.perf_counter()
            kvzip.reconstruct(model, shared.record, shared.rows, probes)
            print(f"re-read of {len(context)} tokens: {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
