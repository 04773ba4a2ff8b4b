"""Verify sparsegen's Wanda and SparseGPT against llm-compressor on the same model and tokens.

llm-compressor pins transformers <= 5.17, so this runs outside the test suite, in its own
environment:

    python3 -m venv /tmp/lcvenv
    /tmp/lcvenv/bin/pip install torch==2.13.0
    /tmp/lcvenv/bin/pip install llmcompressor==0.14.0.1 transformers==5.17.0
    /tmp/lcvenv/bin/pip install --no-deps -e .
    /tmp/lcvenv/bin/python -m sparsegen.bench.peers.compare_llmcompressor --out results/llmcompressor

Both prune the same fp32 model with the same calibration token ids (fp32 calibration forwards on
both sides); perplexity is measured on the same held-out windows, and masks are compared layer by
layer (share of positions where the two agree on zero / non-zero).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def mask_agreement(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    """Share of decoder Linear weight positions where both models agree on zero vs non-zero."""
    agree = total = 0
    theirs_params = dict(theirs.named_parameters())
    for name, weight in ours.named_parameters():
        if ".layers." in name and name.endswith("proj.weight"):
            agree += int(((weight == 0) == (theirs_params[name] == 0)).sum())
            total += weight.numel()
    return agree / total


def _parse_args() -> argparse.Namespace:
    """The command line: calibration and evaluation sizes, the output folder, configurations to skip."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-samples", type=int, default=32)
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--eval-text", default="shakespeare")
    parser.add_argument("--eval-seqlen", type=int, default=2048)
    parser.add_argument("--max-windows", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("results/llmcompressor"))
    parser.add_argument("--skip", type=int, default=0, help="Skip the first N configurations.")
    return parser.parse_args()


def _pruned_by_llmcompressor(modifier, dataset, args: argparse.Namespace) -> tuple[torch.nn.Module, float]:
    """A fresh model pruned to 50% by llm-compressor's `modifier` on the same calibration `dataset`,
    and the seconds it took."""
    from llmcompressor import oneshot

    from sparsegen.loading import load

    theirs, _ = load(packed=False)  # pruned: fp32 on a CPU
    started = time.perf_counter()
    oneshot(
        model=theirs,
        dataset=dataset,
        num_calibration_samples=args.n_samples,
        max_seq_length=args.seqlen,
        recipe=modifier(sparsity=0.5, mask_structure="0:0", targets=[r"re:model.layers.\d+$"], ignore=["lm_head"]),
    )
    return theirs, time.perf_counter() - started


def main() -> None:
    from datasets import Dataset
    from llmcompressor.modifiers.obcq import SparseGPTModifier
    from llmcompressor.modifiers.pruning import WandaPruningModifier

    from sparsegen.data import calibration_samples, load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl
    from sparsegen.loading import load
    from sparsegen.prune import prune

    args = _parse_args()
    _, tokenizer = load()
    calibration = calibration_samples(tokenizer, load_text("shakespeare"), args.n_samples, args.seqlen, seed=0)
    held_out = tokenize_long(tokenizer, load_text(args.eval_text))
    dataset = Dataset.from_dict(
        {"input_ids": calibration.tolist(), "attention_mask": torch.ones_like(calibration).tolist()}
    )
    rows = []
    parser_methods = [
        ("wanda", WandaPruningModifier, {}),
        ("sparsegpt", SparseGPTModifier, {}),
        ("sparsegpt", SparseGPTModifier, {"mask_scope": "block"}),
    ]
    for method, modifier, options in parser_methods[args.skip :]:
        ours, _ = load(packed=False)
        started = time.perf_counter()
        prune(ours, method, 0.5, calibration=calibration, calibration_dtype=None, progress=False, **options)
        ours_seconds = time.perf_counter() - started
        theirs, theirs_seconds = _pruned_by_llmcompressor(modifier, dataset, args)
        ppl_ours = windowed_ppl(ours, held_out, args.eval_seqlen, args.max_windows, progress=False).ppl
        ppl_theirs = windowed_ppl(theirs, held_out, args.eval_seqlen, args.max_windows, progress=False).ppl
        rows.append(
            {
                "method": method + "".join(f" {k}={v}" for k, v in options.items()),
                "ppl_sparsegen": ppl_ours,
                "ppl_llmcompressor": ppl_theirs,
                "ppl_ratio": ppl_ours / ppl_theirs,
                "mask_agreement": mask_agreement(ours, theirs),
                "seconds_sparsegen": ours_seconds,
                "seconds_llmcompressor": theirs_seconds,
            }
        )
        print(rows[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_llmcompressor.json").write_text(
        json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
