"""Zero-shot accuracy through lm-eval, resumable: one task at a time, each result written atomically.

Per task, `<out>/<task>.json` holds the metrics and the settings they were measured with; a rerun
with the same settings reuses it. Inside a task, lm-eval's request cache (`.requests-<key>*.db`,
keyed by the settings) keeps every scored request, so an interrupted task resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from sparsegen.eval.tasks import check_tasks, task_manager
from sparsegen.ioutil import write_json

ZEROSHOT_COLUMNS = [
    ("task", "task"),
    ("items", "items"),
    ("acc", "acc"),
    ("acc_stderr", "± stderr"),
    ("acc_norm", "acc_norm"),
    ("seconds", "seconds"),
]


def task_metrics(results: dict, items: int) -> dict:
    """acc, acc_norm and their standard errors from one lm-eval task result."""
    metrics = {"items": items}
    for name in ("acc", "acc_stderr", "acc_norm", "acc_norm_stderr"):
        if f"{name},none" in results:
            metrics[name] = results[f"{name},none"]
    return metrics


def settings_key(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def evaluate_task(lm, task: str, limit: int | None, request_cache: Path | None = None) -> dict:
    """Run lm-eval on one offline task; returns `task_metrics` plus the wall time."""
    import lm_eval

    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    started = time.perf_counter()
    raw = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task],
        num_fewshot=0,
        limit=limit,
        task_manager=task_manager(),
        use_cache=str(request_cache) if request_cache else None,
        log_samples=False,
    )
    items = raw["n-samples"][task]["effective"]
    return {**task_metrics(raw["results"][task], items), "seconds": round(time.perf_counter() - started, 1)}


def zeroshot_job(
    lm,
    tasks: list[str],
    out_dir: Path,
    limit: int | None = None,
    label: dict | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> dict:
    """Evaluate `lm` (an lm-eval LM) on `tasks`, resuming from `out_dir`; writes `results.json`.

    `label` (e.g. the model name) is recorded with the settings. Returns the summary written:
    settings, per-task metrics, and `mean_acc` over the tasks.
    """
    check_tasks(tasks)
    settings = {**(label or {}), **(lm.settings() if hasattr(lm, "settings") else {}), "limit": limit}
    key = settings_key(settings)
    out_dir.mkdir(parents=True, exist_ok=True)
    per_task: dict[str, dict] = {}
    for number, task in enumerate(tasks, 1):
        path = out_dir / f"{task}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            if saved.get("settings") == settings:
                per_task[task] = saved["metrics"]
                progress(f"[{number}/{len(tasks)}] {task}: done earlier, reused")
                continue
        progress(f"[{number}/{len(tasks)}] {task}")
        metrics = evaluate_task(lm, task, limit, out_dir / f".requests-{key}")
        write_json(path, {"settings": settings, "metrics": metrics})
        per_task[task] = metrics
    accuracies = [m["acc"] for m in per_task.values()]
    summary = {
        "settings": settings,
        "tasks": per_task,
        "mean_acc": sum(accuracies) / len(accuracies),
        "seconds": round(sum(m["seconds"] for m in per_task.values()), 1),
    }
    write_json(out_dir / "results.json", summary)
    return summary


def summary_rows(summary: dict) -> list[dict]:
    """Rows for `report.table`: one per task, then the mean."""
    rows = [{"task": task, **metrics} for task, metrics in summary["tasks"].items()]
    rows.append({"task": "mean", "acc": summary["mean_acc"], "seconds": summary["seconds"]})
    return rows
