"""`sparsegen contextual ...`: per-token neurons or projection inputs."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import (
    METHODS,
    SELECTOR_HELP,
    DeviceOpt,
    HeadSparsityOpt,
    ModelOpt,
    contextual_app,
    err,
    out,
    parse_floats,
    registered_names,
)
from sparsegen.errors import SparsegenError


@contextual_app.command("measure")
def contextual_measure_command(
    model: str = ModelOpt,
    text: str = typer.Option("milton", "--text"),
    tokens: int = typer.Option(512, "--tokens", help="Tokens of the text to measure over."),
    tolerance: float = typer.Option(0.1, "--tolerance", help="Relative error of a block's output that is allowed."),
    out_dir: Path = typer.Option(Path("results/contextual_measure"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Does contextual sparsity exist? Neurons and heads each token needs per layer, against a static set."""
    from sparsegen.contextual.existence import measure_existence
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.loading import load
    from sparsegen.report import markdown_table, plot_lines

    if not 0 < tolerance < 1:
        raise SparsegenError(f"--tolerance must be in (0, 1), got {tolerance}")
    loaded, tokenizer = load(model, packed=False, device=device)  # changes or trains on float weights
    ids = tokenize_long(tokenizer, load_text(text), max_tokens=tokens)[None]
    with err.status(f"measuring {ids.shape[1]} tokens of {text}"):
        rows = measure_existence(loaded, ids, tolerance)
    write_json(out_dir / "contextual_measure.json", {"model": model, "text": text, "tokens": ids.shape[1],
                                                      "tolerance": tolerance, "rows": rows})  # fmt: skip
    columns = [(k, k) for k in rows[0]]
    write_text(out_dir / "contextual_measure.md", markdown_table(rows, columns))
    layers = [r["layer"] for r in rows]
    plot_lines(
        {"MLP neurons": (layers, [r["neurons_needed"] for r in rows]),
         "attention heads": (layers, [r["heads_needed"] for r in rows])},
        out_dir / "needed.png", "layer", f"share a token needs (output within {tolerance:.0%})",
        title=f"{model}: contextual sparsity per layer",
    )  # fmt: skip
    plot_lines(
        {"static neurons": (layers, [r["static_neuron_error"] for r in rows]),
         "static heads": (layers, [r["static_head_error"] for r in rows])},
        out_dir / "static_error.png", "layer", "relative error of a static set of the same size",
        title=f"{model}: a fixed set of the same size",
    )  # fmt: skip
    cosine = [r for r in rows if r["residual_cosine"] is not None]
    plot_lines(
        {"cos(x_l, x_l+1)": ([r["layer"] for r in cosine], [r["residual_cosine"] for r in cosine])},
        out_dir / "residual_cosine.png", "layer", "cosine similarity of consecutive layers' inputs",
        title=f"{model}: the residual stream changes slowly",
    )  # fmt: skip
    out.print(markdown_table(rows, columns))


@contextual_app.command("train")
def contextual_train_command(
    model: str = ModelOpt,
    selector: str = typer.Option("threshold", "--selector", help=SELECTOR_HELP),
    sparsity: float = typer.Option(
        0.5, "--sparsity", help="Share skipped per token, in [0, 1): of MLP neurons (teal: of the layers' weights)."
    ),
    dense_layers: int = typer.Option(0, "--dense-layers", help="First layers left dense."),
    calib_text: str = typer.Option("shakespeare", "--calib-text"),
    n_samples: int = typer.Option(8, "--n-samples"),
    seqlen: int = typer.Option(256, "--seqlen"),
    head_sparsity: float = HeadSparsityOpt,
    out_dir: Path = typer.Option(
        ..., "--out", help="Folder for contextual.safetensors; in a model folder, sparsegen.load installs it."
    ),
    device: str | None = DeviceOpt,
) -> None:
    """Calibrate a selector per layer on real text (teal needs none) and save it next to a model;
    predictors report their recall per layer on held-out calibration tokens, own input and lookahead."""
    from sparsegen.contextual import save_selectors, sparsify
    from sparsegen.contextual.apply import installed_heads
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.ioutil import write_json
    from sparsegen.loading import load
    from sparsegen.report import markdown_table

    loaded, tokenizer = load(model, packed=False, device=device)  # changes or trains on float weights
    calibration = calibration_samples(tokenizer, load_text(calib_text), n_samples, seqlen)
    selectors = sparsify(
        loaded, selector, sparsity, calibration, dense_layers=dense_layers, head_sparsity=head_sparsity
    )
    path = save_selectors(loaded, selectors, out_dir, selector, sparsity)
    rows = []
    for layer, (chosen, heads) in enumerate(zip(selectors, installed_heads(loaded), strict=True)):
        row = {"layer": layer}
        for what, part in (("neurons", chosen), ("heads", heads)):
            if part is not None and hasattr(part, "lookahead_recall"):
                row[f"{what} recall"], row[f"{what} lookahead recall"] = (
                    part.recall.item(),
                    part.lookahead_recall.item(),
                )
        rows.append(row)
    if any(len(row) > 1 for row in rows):
        columns = [(key, key) for key in max(rows, key=len)]
        write_json(out_dir / "contextual_recall.json", {"model": model, "selector": selector, "rows": rows})
        out.print(markdown_table(rows, columns))
        out.print("recall of the top-k set on the last 10% of the calibration tokens (precision equals it: both "
                  "sets have k members); lookahead: predicted from the previous layer's input")  # fmt: skip
    out.print(f"{selector} at {sparsity:.0%} for {sum(s is not None for s in selectors)} layers -> {path}")


@contextual_app.command("eval")
def contextual_eval_command(
    model: str = ModelOpt,
    selectors: str = typer.Option(",".join(METHODS["selectors"]), "--selectors", help=SELECTOR_HELP),
    sparsities: str = typer.Option("0.25,0.4,0.5,0.6", "--sparsities"),
    text: str = typer.Option("milton", "--text", help="A text the calibration does not use."),
    calib_text: str = typer.Option("shakespeare", "--calib-text"),
    seqlen: int = typer.Option(512, "--seqlen"),
    windows: int = typer.Option(8, "--windows"),
    dense_layers: int = typer.Option(0, "--dense-layers"),
    head_sparsity: float = HeadSparsityOpt,
    out_dir: Path = typer.Option(Path("results/contextual_eval"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Perplexity, KL and top-1 agreement against dense, per selector and sparsity (table and plot)."""
    from sparsegen.contextual.quality import quality_curve
    from sparsegen.data import calibration_samples, load_text, tokenize_long
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.loading import load
    from sparsegen.report import markdown_table, plot_lines

    names = registered_names(selectors, METHODS["selectors"], "neuron selector")
    loaded, tokenizer = load(model, packed=False, device=device)  # changes or trains on float weights
    calibration = calibration_samples(tokenizer, load_text(calib_text), 8, 256)
    ids = tokenize_long(tokenizer, load_text(text))
    rows = quality_curve(
        loaded, ids, calibration, names, parse_floats(sparsities), seqlen, windows, dense_layers,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"), head_sparsity=head_sparsity,
    )  # fmt: skip
    columns = [(k, k) for k in ("selector", "sparsity", "kept", "heads", "read", "ppl", "kl", "top1")]
    write_json(out_dir / "contextual_eval.json", {"model": model, "text": text, "seqlen": seqlen, "rows": rows})
    write_text(out_dir / "contextual_eval.md", markdown_table(rows, columns))
    dense = rows[0]["ppl"]
    plot_lines(
        {n: ([1 - r["read"] for r in rows if r["selector"] == n], [r["ppl"] for r in rows if r["selector"] == n])
         for n in names},
        out_dir / "contextual_eval.png", "share of the layers' weights a decode step skips", f"perplexity on {text}",
        title=f"{model}: quality vs contextual sparsity (dense {dense:.2f})",
    )  # fmt: skip
    out.print(markdown_table(rows, columns))
