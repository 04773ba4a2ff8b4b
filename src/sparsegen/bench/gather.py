"""`sparsegen bench gather`: how fast this machine reads the weight rows of kept inputs, against
the dense product.

TEAL and Deja Vu make a decode step read only some rows of each projection's weight. Whether that
is faster than the dense product depends on the machine: a gathered row is a short new stream for
the prefetcher, a dense product one long stream. This measures it on the model's own projections
at one token, per kept share: the dense product, TEAL's gather as shipped (`InputSparseLinear`,
selection included) and the gather alone, and the rate at which the gather reads kept rows as a
share of the dense product's rate (1.0: skipping a row saves all its time).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta

COLUMNS = [
    ("kept", "inputs kept"),
    ("dense_ms", "dense ms"),
    ("gather_ms", "gather ms (as shipped)"),
    ("bag_ms", "gather ms (embedding_bag alone)"),
    ("speedup", "dense / as shipped"),
    ("rate", "kept-row rate / dense rate"),
]


def _mean_ms(fn: Callable[[], object], passes: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(passes):
        fn()
    return (time.perf_counter() - started) / passes * 1e3


@torch.inference_mode()
def bench_gather(
    model_name: str = "smollm2-135m",
    kept: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25),
    passes: int = 20,
    rounds: int = 2,
    out: Path = Path("results/bench_gather"),
    progress: Callable[[str], None] = print,
    device: str | None = None,
) -> list[dict]:
    from sparsegen.contextual.input_sparse import InputSparseLinear
    from sparsegen.contextual.teal import projection_groups
    from sparsegen.loading import load
    from sparsegen.prune.pipeline import decoder_layers

    model, _ = load(model_name, dtype=torch.float32, device=device)  # fp32, as `sparsegen contextual` loads it
    groups = [linears for layer in decoder_layers(model) for linears in projection_groups(layer).values()]
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(1, linears[0].in_features, generator=generator) for linears in groups]

    def dense() -> None:
        for x, linears in zip(inputs, groups, strict=True):
            for linear in linears:
                F.linear(x, linear.weight)

    def shipped(sparse: list[InputSparseLinear]) -> None:
        for x, linear in zip(inputs, sparse, strict=True):
            linear(x)

    def bags(sparse: list[InputSparseLinear], tops: list[torch.Tensor]) -> None:
        for x, linear, top in zip(inputs, sparse, tops, strict=True):
            linear.gathered(x[0], top)

    rows = []
    for share in kept:
        progress(f"{share:.0%} of inputs kept")
        sparse = [InputSparseLinear(linears, 1 - share) for linears in groups]
        tops = [x[0].abs().topk(s.keep, sorted=False).indices for x, s in zip(inputs, sparse, strict=True)]
        timings = [
            (
                _mean_ms(dense, passes),
                _mean_ms(partial(shipped, sparse), passes),
                _mean_ms(partial(bags, sparse, tops), passes),
            )
            for _ in range(rounds)
        ]
        dense_ms, gather_ms, bag_ms = (min(column) for column in zip(*timings, strict=True))
        rows.append({
            "kept": share, "dense_ms": dense_ms, "gather_ms": gather_ms, "bag_ms": bag_ms,
            "speedup": dense_ms / gather_ms, "rate": share * dense_ms / bag_ms,
        })  # fmt: skip
    size_mb = sum(linear.weight.numel() * linear.weight.element_size() for ls in groups for linear in ls) / 1e6
    meta = run_meta(model=model_name, passes=passes, rounds=rounds, projections_mb=round(size_mb, 1))
    write_json(out / "bench_gather.json", {"meta": meta, "rows": rows})
    header = (
        f"model `{model_name}`: its decoder layers' projections ({size_mb:.0f} MB), one token, mean of {passes} "
        f"passes, best of {rounds} rounds; {meta['machine']}, {meta['date']}\n\n"
    )
    write_text(out / "bench_gather.md", header + markdown_table(rows, COLUMNS))
    return rows
