"""Sweeps: a grid of prune x quantize x KV-policy configurations x evaluations, each cell a Ray task.

A grid file (YAML) names the model, the calibration, the axes and the evaluations:

    model: smollm2-135m
    calibration: {text: shakespeare, n_samples: 16, seqlen: 512, seed: 0}
    prune: [null, {method: wanda, sparsity: 0.5}, {method: sparsegpt, pattern: "2:4"}]
    quantize: [null, {bits: 4}]
    kv: [{policy: full}, {policy: h2o, budget: 256}]
    evaluations: [{kind: ppl, text: milton, seqlen: 512, max_windows: 4}, {kind: needle, length: 1024}]

Every combination is one cell, run by `run_cell` (the same function whether Ray runs it or a
user does alone); each finished cell is written atomically to `OUT/cells/`, so a killed sweep
started again runs only the cells not yet written. An evaluation that ignores the KV cache
(windowed perplexity) runs once per weight configuration, not once per policy.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sparsegen.errors import SparsegenError
from sparsegen.ioutil import write_json

if TYPE_CHECKING:
    from sparsegen.kv.spec import KVSpec

EVALUATIONS: dict[str, Callable[..., dict]] = {}
USES_KV = {"stream_ppl", "needle", "zeroshot"}


def evaluation(kind: str):
    def register(function):
        EVALUATIONS[kind] = function
        return function

    return register


@dataclass(frozen=True)
class Cell:
    prune: dict | None
    quantize: dict | None
    kv: dict
    evaluation: dict

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def columns(self) -> dict[str, str]:
        """The cell's settings as table columns: prune, quantize, kv, evaluation."""

        def name(settings, default):
            return ",".join(f"{k}={v}" for k, v in settings.items()) if settings else default

        return {
            "prune": name(self.prune, "dense"),
            "quantize": name(self.quantize, "fp32"),
            "kv": name(self.kv, "-"),
            "evaluation": self.evaluation["kind"],
        }

    @property
    def spec(self) -> KVSpec | None:
        """The cell's KV spec, read from its grid entry (`full` where it names no policy; None for an
        evaluation that ignores the KV)."""
        from sparsegen.kv.spec import KVSpec

        return KVSpec.of(**self.kv) if self.evaluation["kind"] in USES_KV else None

    @property
    def label(self) -> str:
        return " | ".join(self.columns.values())


def cells_of(grid: dict) -> list[Cell]:
    """Every combination of the grid's axes; a KV-blind evaluation gets one cell per weight setting."""
    for kind in (e.get("kind") for e in grid.get("evaluations", [])):
        if kind not in EVALUATIONS:
            raise SparsegenError(f"unknown evaluation {kind!r}; choose one of: {', '.join(sorted(EVALUATIONS))}")
    if not grid.get("evaluations"):
        raise SparsegenError("the grid names no evaluations: add `evaluations: [{kind: ppl}]`")
    cells = []
    for prune, quantize, evaluation_ in itertools.product(
        grid.get("prune", [None]), grid.get("quantize", [None]), grid["evaluations"]
    ):
        policies = grid.get("kv", [{"policy": "full"}]) if evaluation_["kind"] in USES_KV else [{}]
        cells += [Cell(prune, quantize, kv, evaluation_) for kv in policies]
    for cell in cells:
        _ = cell.spec  # a bad KV entry fails here, before any cell runs, as one line
    return cells


def run_cell(model: str, calibration: dict, cell: Cell, threads: int = 1, device: str | None = None) -> dict:
    """The metrics of one cell: load, prune, quantize, evaluate, on `threads` CPU threads."""
    import torch

    from sparsegen.data import calibration_samples, load_text
    from sparsegen.loading import load
    from sparsegen.prune import prune
    from sparsegen.quant import quantize

    torch.set_num_threads(threads)
    loaded, tokenizer = load(model, packed=False, device=device)
    ids = None
    if cell.prune or cell.quantize:
        settings = {"text": "shakespeare", "n_samples": 16, "seqlen": 512, "seed": 0, **calibration}
        text = load_text(settings["text"])
        ids = calibration_samples(tokenizer, text, settings["n_samples"], settings["seqlen"], settings["seed"])
    if cell.prune:
        prune(loaded, calibration=ids, progress=False, **cell.prune)
    if cell.quantize:
        quantize(loaded, calibration=ids, progress=False, **cell.quantize)
    params = {k: v for k, v in cell.evaluation.items() if k != "kind"}
    return EVALUATIONS[cell.evaluation["kind"]](loaded, tokenizer, cell.spec, **params)


@evaluation("ppl")
def _windowed(model, tokenizer, kv: KVSpec | None, text="milton", seqlen=512, max_windows=4) -> dict:
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl

    result = windowed_ppl(model, tokenize_long(tokenizer, load_text(text)), seqlen, max_windows, progress=False)
    return {"ppl": result.ppl}


@evaluation("stream_ppl")
def _streaming(model, tokenizer, kv: KVSpec, text="milton", tokens=2048, chunk=16) -> dict:
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.stream_ppl import stream_ppl

    ids = tokenize_long(tokenizer, load_text(text))[:tokens]
    result = stream_ppl(model, ids, kv, chunk=chunk, progress=False)
    return {"ppl": result.ppl}


@evaluation("needle")
def _needle(model, tokenizer, kv: KVSpec, text="shakespeare", length=1024, depths=(0.0, 0.5, 1.0), trials=2) -> dict:
    from sparsegen.data import load_text
    from sparsegen.eval.needle import spec_accuracy

    return {"accuracy": spec_accuracy(model, tokenizer, load_text(text), kv, list(depths), length, trials)}


@evaluation("zeroshot")
def _zeroshot(model, tokenizer, kv: KVSpec, tasks=("arc_easy",), limit=50) -> dict:
    import tempfile

    from sparsegen.eval.harness import SparsegenLM
    from sparsegen.eval.zeroshot import zeroshot_job

    lm = SparsegenLM.over((model, tokenizer), kv)
    with tempfile.TemporaryDirectory() as scratch:
        summary = zeroshot_job(lm, list(tasks), Path(scratch), limit)
    return {"acc": summary["mean_acc"], **{f"acc_{task}": m["acc"] for task, m in summary["tasks"].items()}}


def sweep(
    grid: dict,
    out: str | Path,
    address: str | None = None,
    progress: Callable[[str], None] = lambda message: None,
    device: str | None = None,
) -> list[dict]:
    """Run every cell not yet in `out/cells/` as a Ray task (a local Ray unless `address`); returns
    one row per cell, finished earlier or now: its settings (`Cell.columns`), `cell` (one label)
    and its metrics."""
    try:
        import ray
    except ImportError:
        raise SparsegenError("sweeps run on Ray: pip install 'sparsegen[ray]'") from None
    out = Path(out)
    cells = cells_of(grid)
    done = {cell.key for cell in cells if (out / "cells" / f"{cell.key}.json").exists()}
    todo = [cell for cell in cells if cell.key not in done]
    progress(f"{len(cells)} cells: {len(done)} done earlier, {len(todo)} to run")
    if todo:
        threads = int(grid.get("threads_per_cell", 1))
        ray.init(address=address, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        try:
            task = ray.remote(num_cpus=threads)(run_cell)
            pending = {
                task.remote(grid["model"], grid.get("calibration", {}), cell, threads, device=device): cell
                for cell in todo
            }
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                cell = pending.pop(ready[0])
                spec = None if cell.spec is None else cell.spec.to_dict()
                record = {"cell": asdict(cell), "kv": spec, "metrics": ray.get(ready[0])}
                write_json(out / "cells" / f"{cell.key}.json", record)
                progress(f"[{len(cells) - len(pending)}/{len(cells)}] {cell.label}")
        finally:
            ray.shutdown()
    rows = []
    for cell in cells:
        saved = json.loads((out / "cells" / f"{cell.key}.json").read_text())
        rows.append({**cell.columns, "cell": cell.label, **saved["metrics"]})
    return rows
