"""`sparsegen bench zeroshot`: the seeds' zero-shot tables on this project's models, in one run.

(a) Wanda's table: dense, magnitude, Wanda and SparseGPT at 50% unstructured and 2:4, per task
and the mean; beside it lm-eval's own transformers backend on the dense model, the cross-check.
(b) H2O's lm-eval figure: the full cache against h2o, streaming and window at a share of each
request. Every row is resumable (`zeroshot_job` writes each task as it finishes).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from sparsegen.errors import SparsegenError
from sparsegen.eval.zeroshot import zeroshot_job
from sparsegen.ioutil import write_json, write_text
from sparsegen.kv import POLICIES
from sparsegen.kv.spec import KVSpec
from sparsegen.prune import PRUNERS
from sparsegen.report import markdown_table, run_meta

PRUNE_ROWS = [("dense", None)] + [(m, p) for p in ("unstructured", "2:4") for m in sorted(PRUNERS)]


def _done(folder: Path, tasks: list[str], limit: int | None) -> dict | None:
    """The saved summary of a row finished with these tasks and items, so a rerun skips its pruning too."""
    path = folder / "results.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if list(summary["tasks"]) == tasks and summary["settings"]["limit"] == limit else None


def _row(label: dict, summary: dict) -> dict:
    return {**label, **{t: m["acc"] for t, m in summary["tasks"].items()}, "mean": summary["mean_acc"]}


def bench_zeroshot(
    model_name: str = "smollm2-135m",
    tasks: list[str] | None = None,
    limit: int | None = 100,
    share: float = 0.2,
    calib_text: str = "shakespeare",
    n_samples: int = 32,
    seqlen: int = 512,
    batch_size: int = 8,
    out: Path = Path("results/bench_zeroshot"),
    progress=print,
    device: str | None = None,
) -> dict:
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.eval.harness import SparsegenLM
    from sparsegen.eval.tasks import TASKS, check_tasks
    from sparsegen.loading import load
    from sparsegen.prune import prune

    tasks = check_tasks(tasks or list(TASKS))
    started = time.perf_counter()
    calibration = None

    def run(folder: Path, label: dict, make_lm) -> dict:
        summary = _done(folder, tasks, limit)
        if summary is None:
            progress(f"{' '.join(str(v) for v in label.values())}")
            summary = zeroshot_job(
                make_lm(), tasks, folder, limit, label={"model": model_name, **label}, progress=progress
            )
        return _row(label, summary)

    def pruned_lm(method: str, pattern: str | None):
        nonlocal calibration
        model, tokenizer = load(model_name, device=device)
        if method != "dense":
            if calibration is None:
                calibration = calibration_samples(tokenizer, load_text(calib_text), n_samples, seqlen)
            structure = None if pattern == "unstructured" else pattern
            prune(model, method, 0.5, structure, calibration=calibration, progress=False)
        return SparsegenLM(loaded=(model, tokenizer), batch_size=batch_size)

    pruning = _pruning_rows(run, pruned_lm, model_name, batch_size, folder=out / "prune")
    kv = _kv_rows(run, load(model_name, device=device), share, dense=pruning[0], folder=out / "kv")
    result = run_meta(
        model=model_name,
        tasks=tasks,
        limit=limit,
        share=share,
        calibration=f"{n_samples}x{seqlen}",
        calib_text=calib_text,
        pruning=pruning,
        kv=kv,
        seconds=round(time.perf_counter() - started),
    )
    write_json(out / "bench_zeroshot.json", result)
    write_text(out / "bench_zeroshot.md", _tables(pruning, kv, tasks, limit, share))
    return result


def _pruning_rows(
    run: Callable[[Path, dict, Callable], dict],
    pruned_lm: Callable[[str, str | None], object],
    model_name: str,
    batch_size: int,
    folder: Path,
) -> list[dict]:
    """Every row of `PRUNE_ROWS` (the model from `pruned_lm(method, pattern)`), then the dense model
    under lm-eval's own transformers backend, the cross-check, through `run(folder, label, make_lm)`."""
    from lm_eval.models.huggingface import HFLM

    from sparsegen.loading import resolve_model_path

    pruning = [
        run(
            folder / f"{method}-{(pattern or 'none').replace(':', 'of')}",
            {"method": method, "pattern": pattern},
            lambda m=method, p=pattern: pruned_lm(m, p),
        )
        for method, pattern in PRUNE_ROWS
    ]
    pruning.append(
        run(
            folder / "lm-eval-hf",
            {"method": "dense (lm-eval hf backend)", "pattern": None},
            lambda: HFLM(pretrained=resolve_model_path(model_name), device="cpu", batch_size=batch_size),
        )
    )
    return pruning


def _kv_rows(
    run: Callable[[Path, dict, Callable], dict], loaded: tuple, share: float, dense: dict, folder: Path
) -> list[dict]:
    """The full cache (the dense model of the pruning table: its row is reused, not recomputed),
    then every other policy at `share` of each request, through `run(folder, label, make_lm)`."""
    from sparsegen.eval.harness import SparsegenLM

    full = {**dense, "method": None, "pattern": None, "policy": "full", "budget": None}
    return [full] + [
        run(
            folder / policy,
            {"policy": policy, "budget": share},
            lambda p=policy: SparsegenLM(loaded=loaded, policy=p, **_share_settings(p, share)),
        )
        for policy in sorted(POLICIES)
        if policy != "full"
    ]


def _share_settings(policy: str, share: float) -> dict:
    """H2O's "share of each request" as `policy`'s settings: its whole budget, or, where the policy
    refuses a share because a window of it is a token count (SnapKV, PyramidKV, DuoAttention), the
    share its scored tokens keep beside that window (`heavy=`); 4 sinks where it has sinks."""
    sinks = {"sinks": 4} if "sinks" in POLICIES[policy].budget_parts() else {}
    try:
        KVSpec.of(policy, budget=share, **sinks)
    except SparsegenError:
        return {"heavy": share, **sinks}
    return {"budget": share, **sinks}


def _tables(pruning: list[dict], kv: list[dict], tasks: list[str], limit: int | None, share: float) -> str:
    """Both tables in markdown: accuracy per task and the mean, per pruning row and per KV policy."""
    task_columns = [(t, t) for t in tasks] + [("mean", "mean")]
    return (
        f"Weight sparsity at 50% (acc, {limit or 'all'} items per task)\n\n"
        + markdown_table(pruning, [("method", "method"), ("pattern", "pattern"), *task_columns])
        + f"\nKV policies at {share:.0%} of each request (acc)\n\n"
        + markdown_table(kv, [("policy", "policy"), ("budget", "budget"), *task_columns])
    )
