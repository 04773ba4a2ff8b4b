"""`sparsegen eval prune-quality`: perplexity and pruning time per method and pattern, one run.

The quality side of weight pruning (speed is `sparsegen bench prune`): every method and pattern is
pruned from the same dense model on the same calibration tokens and scored on the same windows.
"""

from __future__ import annotations

from pathlib import Path

from sparsegen.ioutil import write_json, write_text
from sparsegen.report import markdown_table, run_meta

QUALITY_COLUMNS = [
    ("method", "method"),
    ("pattern", "pattern"),
    ("sparsity", "sparsity"),
    ("owl", "OWL"),
    ("ppl", "perplexity"),
    ("seconds", "pruning s"),
]


def prune_quality(
    model_name: str = "smollm2-135m",
    calib_text: str = "shakespeare",
    eval_text: str = "shakespeare",
    n_samples: int = 32,
    seqlen: int = 512,
    eval_seqlen: int = 2048,
    max_windows: int = 8,
    out: Path = Path("results/prune_quality"),
    progress=print,
    device: str | None = None,
) -> list[dict]:
    """Perplexity and pruning time of each method x pattern (and OWL at 70%), dense in the same run."""
    from sparsegen.data import calibration_samples, load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl
    from sparsegen.loading import load
    from sparsegen.prune import PRUNERS, prune

    model, tokenizer = load(model_name, packed=False, device=device)  # pruned below: fp32 on a CPU
    calibration = calibration_samples(tokenizer, load_text(calib_text), n_samples, seqlen)
    held_out = tokenize_long(tokenizer, load_text(eval_text))
    configs = [(m, 0.5, p, False) for p in (None, "4:8", "2:4") for m in sorted(PRUNERS)]
    calibrated = [m for m in sorted(PRUNERS) if PRUNERS[m].needs_calibration]  # OWL's setting: 70%, with and without
    configs += [(m, 0.7, None, owl) for m in calibrated for owl in (False, True)]
    rows = [
        {
            "method": "dense",
            "pattern": "-",
            "sparsity": 0.0,
            "owl": "-",
            "seconds": None,
            "ppl": windowed_ppl(model, held_out, eval_seqlen, max_windows, progress=False).ppl,
        }
    ]
    out.mkdir(parents=True, exist_ok=True)
    for method, sparsity, pattern, owl in configs:
        progress(f"{method} {pattern or sparsity}{' OWL' if owl else ''}")
        model, _ = load(model_name, packed=False, device=device)
        report = prune(model, method, sparsity, pattern, calibration=calibration, owl=owl, progress=False)
        rows.append(
            {
                "method": method,
                "pattern": report.pattern,
                "sparsity": sparsity,
                "owl": "yes" if owl else "no",
                "seconds": report.seconds,
                "ppl": windowed_ppl(model, held_out, eval_seqlen, max_windows, progress=False).ppl,
            }
        )
        write_json(out / "prune_quality.json", rows)  # finished rows survive an interruption
    meta = (
        f"model `{model_name}`, calibration {n_samples} x {seqlen} tokens of `{calib_text}` (seed 0), "
        f"perplexity over the first {max_windows} windows of {eval_seqlen} tokens of `{eval_text}`, "
        f"{run_meta()['machine']}, {run_meta()['date']}\n\n"
    )
    write_text(out / "prune_quality.md", meta + markdown_table(rows, QUALITY_COLUMNS))
    return rows
