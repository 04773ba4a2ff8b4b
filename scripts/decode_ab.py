"""Batch-1 decode through the KV paths, for an A/B of two checkouts (docs/benchmarks.md, "The house
rebuilt"): run it alternately with each checkout's `src` first on PYTHONPATH, a fresh process each
time, on a quiet machine, and compare the ratios pair by pair.

    PYTHONPATH=OLD/src python scripts/decode_ab.py [CHECKPOINT ...]
    PYTHONPATH=NEW/src python scripts/decode_ab.py [CHECKPOINT ...]

Eager: the default model in fp32 after 1,024 tokens of Shakespeare, 96 new tokens, the best of 3,
under four KV specs. Compiled: `bench peers`' own worker (full cache, 1,024 tokens, 64 new) on each
packed CHECKPOINT folder given (`bench peers` writes its RTN checkpoints under OUT/checkpoints);
a folder whose name holds "int4" is also run with integer dots (activation_bits=8).
"""

import sys

import torch

import sparsegen
from sparsegen.bench.decode import fast_decode_worker
from sparsegen.kv.spec import KVSpec

EAGER = {
    "full": KVSpec.of("full"),
    "h2o-512": KVSpec.of("h2o", budget=512),
    "streaming-512-int4": KVSpec.of("streaming", budget=512, kv_bits=4),
    "adakv-512": KVSpec.of("adakv", budget=512),
}


def main(checkpoints: list[str]) -> None:
    torch.manual_seed(0)
    model, tokenizer = sparsegen.load()
    ids = torch.as_tensor(sparsegen.tokenize_long(tokenizer, sparsegen.load_text("shakespeare"), 1024))
    ids = ids.view(1, -1)[:, :1024]
    for name, kv in EAGER.items():
        best = min(sparsegen.generate(model, ids, 96, kv, compile="never").ms_per_step for _ in range(3))
        print(f"{name} {best:.3f}", flush=True)
    for folder in checkpoints:
        runs = [("", {})] + ([("-dot", {"activation_bits": 8})] if "int4" in folder else [])
        for suffix, options in runs:
            result = fast_decode_worker(folder, "shakespeare", 1024, 64, "fp32", "full", 1, 2, **options)
            print(f"{folder.rstrip('/').rsplit('/', 1)[-1]}{suffix}-compiled {result['ms']:.3f}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
