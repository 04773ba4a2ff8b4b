"""What a RULER sample's big decode batch costs before its first step: making every shared-context
cell's cache from the shared read (`SharedPrefill.cache_for`, KVzip's re-read included), reading
the question into each row's cache (`Decoder.prefill`), and the hand-over to the decode slots
(`Decoder.start_from`) (docs/benchmarks.md, RULER section). Run it on a quiet machine.

    python scripts/ruler_cells_setup_time.py results/ruler-4k-now/samples/niah_multivalue-4096.json
"""

import sys
import time
from pathlib import Path

from ruler_sample import load_sample

from sparsegen.cli.common import METHODS
from sparsegen.decode import Decoder
from sparsegen.eval.ruler import RulerSettings, _cells, _decode_groups
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.shared import SharedPrefill


def main(samples: Path) -> None:
    model, _, context, question = load_sample(samples)
    settings = RulerSettings("smollm2-135m", ("niah_single_1",), (4096,), 1, tuple(METHODS["policies"]))
    with policy_attention(model):
        shared = SharedPrefill(model, context)
        group = max(_decode_groups(_cells(settings), len(context), settings), key=len)
        started = time.perf_counter()
        caches = [shared.cache_for(cell["policy"]) for cell in group]
        print(f"{len(group)} cells' caches: {time.perf_counter() - started:.2f} s", flush=True)
        decoder = Decoder(model, group[0]["policy"], compile="never")
        started = time.perf_counter()
        prefilled, _ = decoder.prefill([question] * len(group), caches)
        print(f"{len(question)}-token question into each: {time.perf_counter() - started:.2f} s", flush=True)
        started = time.perf_counter()
        decoder.start_from(prefilled, 128, shared)
        print(f"hand-over: {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
