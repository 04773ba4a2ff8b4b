"""`sparsegen eval ...`: perplexity, pruning quality, needle retrieval, zero-shot accuracy."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import (
    METHODS,
    POLICY_HELP,
    CompressEveryOpt,
    DeviceOpt,
    FromDiskOpt,
    KvBitsOpt,
    ModelOpt,
    PositionOpt,
    SinksOpt,
    err,
    eval_app,
    out,
    parse_floats,
    reads_from_disk,
    registered_names,
)
from sparsegen.errors import SparsegenError

DECODING = ("window", "streaming", "h2o", "streaming_h2o", "tova", "rkv", "triattention")
"""The policies that evict while decoding (`eval.long_output.DECODING_POLICIES`, named here without torch)."""


@eval_app.command("prune-quality")
def prune_quality_command(
    model: str = ModelOpt,
    calib_text: str = typer.Option("shakespeare", "--calib-text"),
    eval_text: str = typer.Option("shakespeare", "--eval-text"),
    n_samples: int = typer.Option(32, "--n-samples"),
    seqlen: int = typer.Option(512, "--seqlen"),
    eval_seqlen: int = typer.Option(2048, "--eval-seqlen"),
    max_windows: int = typer.Option(8, "--max-windows"),
    out_dir: Path = typer.Option(Path("results/prune_quality"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Perplexity and pruning time per method and pattern (50%, 4:8, 2:4; OWL at 70%)."""
    from sparsegen.eval.prune_quality import prune_quality

    prune_quality(
        model,
        calib_text,
        eval_text,
        n_samples,
        seqlen,
        eval_seqlen,
        max_windows,
        out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        device=device,
    )
    out.print((out_dir / "prune_quality.md").read_text())


@eval_app.command("ppl")
def eval_ppl(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Window length (stated with every result)."),
    max_windows: int = typer.Option(
        16, "--max-windows", help="Evaluate the first N windows (minutes on a CPU); 0: the whole text."
    ),
    from_disk: bool | None = FromDiskOpt,
    json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON here."),
    device: str | None = DeviceOpt,
) -> None:
    """Windowed perplexity: non-overlapping windows of SEQLEN, remainder dropped, exp(mean NLL)."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl
    from sparsegen.ioutil import write_json
    from sparsegen.loading import load
    from sparsegen.scale import DiskBlocks, open_lazy

    blocks = None
    if reads_from_disk(model, from_disk):
        loaded, tokenizer, checkpoint = open_lazy(model)
        blocks = DiskBlocks(loaded, checkpoint)
    else:
        loaded, tokenizer = load(model, device=device)
    ids = tokenize_long(tokenizer, load_text(text))
    result = windowed_ppl(loaded, ids, seqlen, max_windows or None, blocks=blocks)
    summary = {"model": model, "text": text, **result.summary()}
    out.print(f"perplexity {result.ppl:.3f} ({result.windows} windows x {seqlen} tokens of {text})")
    if json_out is not None:
        write_json(json_out, summary)


@eval_app.command("needle")
def eval_needle(
    model: str = ModelOpt,
    policies: str = typer.Option(",".join(METHODS["policies"]), "--policies", help=POLICY_HELP),
    budgets: str = typer.Option("256,1024", "--budgets", help="Total KV budgets, comma-separated."),
    length: int = typer.Option(2048, "--length", help="Context tokens (filler + needle)."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths, 0 = start of the context."),
    trials: int = typer.Option(4, "--trials", help="Passkeys (and filler offsets) per cell."),
    chunk: int | None = typer.Option(None, "--chunk", help="Read the context in pieces [default: one forward]."),
    filler: str = typer.Option("shakespeare", "--filler", help="Embedded text name or a .txt file."),
    out_dir: Path = typer.Option(Path("results/needle"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Passkey retrieval per policy, budget and depth, asked after the context was compressed (heat map)."""
    from sparsegen.data import load_text
    from sparsegen.eval.needle import needle_job, plot_heatmap
    from sparsegen.loading import load
    from sparsegen.report import markdown_table

    names = registered_names(policies, METHODS["policies"], "KV policy")
    depth_list = [float(d) for d in depths.split(",")]
    loaded, tokenizer = load(model, device=device)
    rows = needle_job(
        loaded,
        tokenizer,
        load_text(filler),
        names,
        [int(b) for b in budgets.split(",")],
        depth_list,
        length,
        trials,
        out_dir,
        chunk,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
    )
    reading = f"chunks of {chunk}" if chunk else "one forward, compressed after it"
    plot_heatmap(rows, depth_list, out_dir / "needle.png", f"passkey retrieval, {length}-token context ({reading})")
    table_rows = []
    for policy, budget in dict.fromkeys((r["policy"], r["budget"]) for r in rows):
        cells = {f"{r['depth']:.0%}": r["accuracy"] for r in rows if (r["policy"], r["budget"]) == (policy, budget)}
        table_rows.append({"policy": policy, "budget": budget or "all", **cells})
    columns = [("policy", "policy"), ("budget", "budget"), *[(f"{d:.0%}", f"{d:.0%}") for d in depth_list]]
    out.print(markdown_table(table_rows, columns))
    out.print(f"wrote {out_dir}/needle.json and {out_dir}/needle.png")


@eval_app.command("ruler")
def eval_ruler(
    model: str = ModelOpt,
    tasks: str = typer.Option("all", "--tasks", help="RULER tasks, comma-separated [default: all 13]."),
    lengths: str = typer.Option("4096", "--lengths", help="Sequence lengths in the model's tokens, comma-separated."),
    samples: int = typer.Option(5, "--samples", help="Samples per task and length."),
    policies: str = typer.Option(",".join(METHODS["policies"]), "--policies", help=POLICY_HELP),
    ratios: str = typer.Option("0.25,0.5,0.75,0.875", "--ratios", help="Compression ratios (share evicted)."),
    protocol: str = typer.Option("query-agnostic", "--protocol", help="query-agnostic or query-aware."),
    haystack: Path | None = typer.Option(None, "--haystack", help="A text file to use instead of the essays."),
    seed: int = typer.Option(42, "--seed", help="The generators' random seed."),
    separate_prefill: bool = typer.Option(
        False,
        "--separate-prefill",
        help="Read each context once per policy x ratio (checks and times the shared read).",
    ),
    duo_heads: Path | None = typer.Option(
        None,
        "--duo-heads",
        help="duo_attention's retrieval heads (`sparsegen eval calibrate-heads`); else scored on each prompt.",
    ),
    kv_bits: int | None = KvBitsOpt,
    out_dir: Path = typer.Option(Path("results/ruler"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """RULER accuracy per KV policy and compression ratio, the full cache in the same run (resumable)."""
    from sparsegen.eval.ruler import RulerSettings, plot, ruler_job, summary
    from sparsegen.eval.ruler_data import check_tasks, task_table
    from sparsegen.ioutil import write_text
    from sparsegen.loading import load
    from sparsegen.report import markdown_table, table

    for option, path in (("--haystack", haystack), ("--duo-heads", duo_heads)):
        if path is not None and not path.is_file():
            raise SparsegenError(f"{option} {path}: no such file")
    names = list(task_table()) if tasks == "all" else check_tasks([t.strip() for t in tasks.split(",") if t.strip()])
    settings = RulerSettings(
        model=model,
        tasks=tuple(names),
        lengths=tuple(parse_floats(lengths, int)),
        samples=samples,
        policies=tuple(registered_names(policies, METHODS["policies"], "KV policy")),
        ratios=tuple(parse_floats(ratios)),
        protocol=protocol,
        seed=seed,
        haystack=None if haystack is None else str(haystack.resolve()),
        separate_prefill=separate_prefill,
        duo_heads=None if duo_heads is None else str(duo_heads.resolve()),
        kv_bits=kv_bits,
    )
    loaded, tokenizer = load(model, device=device)
    records = ruler_job(loaded, tokenizer, settings, out_dir)
    report = []
    for length, rows in summary(records).items():
        columns = [("policy", "policy"), ("ratio", "ratio"), *[(t, t) for t in names], ("average", "average")]
        out.print(table(rows, columns, title=f"RULER at {length} tokens · {model} · {protocol}"))
        report.append(f"## {length} tokens\n\n{markdown_table(rows, columns)}")
        plot(rows, out_dir / f"ruler_{length}.png", f"RULER at {length} tokens, {model} ({protocol})")
    write_text(out_dir / "results.md", "\n".join(report))
    out.print(f"wrote {out_dir}/results.json, results.md and ruler_<length>.png")


@eval_app.command("calibrate-heads")
def calibrate_heads_command(
    model: str = ModelOpt,
    samples: int = typer.Option(4, "--samples", help="Synthetic passkey prompts."),
    length: int = typer.Option(1024, "--length", help="Tokens per prompt."),
    out_file: Path = typer.Option(Path("results/duo_heads.json"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Which KV heads retrieve (duo_attention's heads=): attention paid to passkey needles while answering."""
    from sparsegen.eval.calibrate_heads import calibrate_heads, save_heads
    from sparsegen.loading import load

    if samples < 1 or length < 64:
        raise SparsegenError("--samples must be >= 1 and --length >= 64")
    loaded, tokenizer = load(model, device=device)
    scores = calibrate_heads(loaded, tokenizer, samples, length)
    save_heads(scores, out_file, model)
    heads = scores.shape[1]
    best = scores.flatten().topk(min(5, scores.numel())).indices.tolist()
    top = ", ".join(f"L{i // heads}H{i % heads}" for i in best)
    out.print(f"wrote {out_file}: {scores.shape[0]} layers x {scores.shape[1]} KV heads; most retrieving: {top}")


@eval_app.command("calibrate-centres")
def calibrate_centres_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file."),
    tokens: int = typer.Option(2048, "--tokens", help="Tokens of the text read."),
    out_file: Path = typer.Option(Path("results/centres.json"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Where each query head's queries sit before RoPE (triattention's centres=), over a text."""
    from sparsegen.data import load_text
    from sparsegen.eval.calibrate_heads import query_centres, save_centres
    from sparsegen.loading import load

    if tokens < 64:
        raise SparsegenError(f"--tokens must be >= 64, got {tokens}")
    loaded, tokenizer = load(model, device=device)
    ids = tokenizer(load_text(text), add_special_tokens=False)["input_ids"][:tokens]
    mean, magnitude = query_centres(loaded, ids)
    save_centres(mean, magnitude, out_file, model, text)
    out.print(f"wrote {out_file}: {mean.shape[0]} layers x {mean.shape[1]} query heads, from {len(ids)} tokens")


@eval_app.command("zeroshot")
def eval_zeroshot(
    model: str = ModelOpt,
    tasks: str = typer.Option(None, "--tasks", help="Comma-separated offline tasks [default: all eight]."),
    policy: str = typer.Option("full", "--policy", help=POLICY_HELP),
    budget: str | None = typer.Option(None, "--budget", help="Total KV budget: tokens (int) or share (0.2)."),
    sinks: int | None = SinksOpt,
    heavy: str | None = typer.Option(None, "--heavy", help="Heavy hitters: tokens or share of the request."),
    recent: str | None = typer.Option(None, "--recent", help="Recent tokens: tokens or share of the request."),
    position: str | None = PositionOpt,
    chunk: int | None = typer.Option(None, "--chunk", help="Read each context this many tokens at a time."),
    limit: int | None = typer.Option(None, "--limit", help="First N items of each task."),
    batch_size: int = typer.Option(8, "--batch-size", help="Requests per forward (without a KV policy)."),
    out_dir: Path = typer.Option(Path("results/zeroshot"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Zero-shot accuracy with lm-eval's prompts and metrics on offline task data (resumable)."""
    from sparsegen.eval.harness import SparsegenLM
    from sparsegen.eval.tasks import TASKS, check_tasks
    from sparsegen.eval.zeroshot import ZEROSHOT_COLUMNS, summary_rows, zeroshot_job
    from sparsegen.kv.policy import count_or_share
    from sparsegen.report import table

    names = check_tasks([t.strip() for t in tasks.split(",") if t.strip()] if tasks else list(TASKS))
    lm = SparsegenLM(
        model=model,
        policy=policy,
        budget=count_or_share(budget),
        sinks=sinks,
        heavy=count_or_share(heavy),
        recent=count_or_share(recent),
        position=position,
        chunk=chunk,
        batch_size=batch_size,
        device=device,
    )
    summary = zeroshot_job(
        lm, names, out_dir, limit, label={"model": model}, progress=lambda msg: err.print(f"[dim]{msg}[/]")
    )
    title = f"{model} · {lm.policy}" + (f" · limit {limit}" if limit else "")
    out.print(table(summary_rows(summary), ZEROSHOT_COLUMNS, title=title))
    out.print(f"wrote {out_dir}/results.json")


@eval_app.command("long-output")
def long_output_command(
    model: str = ModelOpt,
    prompt: str = typer.Option("text", "--prompt", help="text (continue a text) or code (ask for a program)."),
    tokens: int = typer.Option(2048, "--tokens", help="Tokens the full cache writes and every policy follows."),
    budget: float = typer.Option(0.25, "--budget", help="Each policy's KV budget as a share of --tokens."),
    policies: str = typer.Option(",".join(DECODING), "--policies", help="Policies that evict while decoding."),
    text: str = typer.Option("shakespeare", "--text", help="The text whose opening --prompt text continues."),
    compile: str = typer.Option("never", "--compile", help="never, auto or always: the decoders' step."),
    centres: Path | None = typer.Option(
        None, "--centres", help="triattention's query centres (`eval calibrate-centres`); else from --text."
    ),
    compress_every: int = CompressEveryOpt,
    out_dir: Path = typer.Option(Path("results/long_output"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Fidelity while the model writes: each policy's next-token choice and KL against the full
    cache's, along the full cache's own greedy output."""
    from sparsegen.eval.long_output import COLUMNS, long_output
    from sparsegen.report import markdown_table

    if centres is not None and not centres.is_file():
        raise SparsegenError(f"--centres {centres}: no such file (make one with `sparsegen eval calibrate-centres`)")
    names = tuple(name for name in policies.split(",") if name)
    result = long_output(model, prompt, tokens, budget, names, text, out_dir, compile, device, centres, compress_every)
    out.print(markdown_table(result["rows"], COLUMNS))
    out.print(f"wrote {out_dir}/long_output.json, .md and .png")
