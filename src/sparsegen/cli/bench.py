"""`sparsegen bench ...`: speed and memory, side by side with baselines."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import METHODS, SELECTOR_HELP, DeviceOpt, ModelOpt, bench_app, err, out, parse_floats
from sparsegen.errors import SparsegenError


@bench_app.command("decode")
def bench_decode_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    context: int = typer.Option(1024, "--context", help="Tokens before decoding starts."),
    long_context: int = typer.Option(
        8000, "--long-context", help="Context of the streaming vs dense comparison (0: skip it)."
    ),
    cache: int = typer.Option(1024, "--cache", help="Streaming cache size (4 sinks + the rest recent)."),
    new_tokens: int = typer.Option(96, "--new-tokens", help="Tokens decoded per measurement."),
    quantized: bool = typer.Option(
        True, "--quantized/--no-quantized", help="Add int8 and int4 (RTN) checkpoints decoding packed."
    ),
    llama_cpp: str | None = typer.Option(
        None, "--llama-cpp", help="A Python with llama-cpp-python installed: adds llama.cpp on the model's GGUF."
    ),
    out_dir: Path = typer.Option(Path("results/bench_decode"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """The fast decode path vs generate() (fp32, bf16 weights, int8/int4 packed, llama.cpp), and
    streaming vs dense, against the memory-bandwidth bound measured in the same run."""
    from sparsegen.bench.decode import bench_decode

    bench_decode(
        model,
        text,
        context,
        long_context,
        new_tokens,
        cache,
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
        quantized=quantized,
        llama_cpp=llama_cpp,
        device=device,
    )
    out.print((out_dir / "bench_decode.md").read_text())
    out.print(f"wrote {out_dir}/bench_decode.md and .json")


@bench_app.command("prune")
def bench_prune_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    n_samples: int = typer.Option(16, "--n-samples"),
    seqlen: int = typer.Option(512, "--seqlen"),
    sparsities: str = typer.Option("0.5,0.7,0.9", "--sparsities"),
    out_dir: Path = typer.Option(Path("results/bench_prune"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Pruning time per method, and decode speed dense vs CSR per sparsity."""
    from sparsegen.bench.prune import bench_prune

    bench_prune(
        model,
        text,
        n_samples,
        seqlen,
        tuple(float(s) for s in sparsities.split(",")),
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        device=device,
    )
    out.print((out_dir / "bench_prune.md").read_text())


@bench_app.command("zeroshot")
def bench_zeroshot_command(
    model: str = ModelOpt,
    tasks: str = typer.Option(None, "--tasks", help="Comma-separated offline tasks [default: all eight]."),
    limit: int | None = typer.Option(100, "--limit", help="First N items of each task (0 = all)."),
    share: float = typer.Option(0.2, "--share", help="KV budget as a share of each request."),
    n_samples: int = typer.Option(32, "--n-samples", help="Calibration samples for pruning."),
    seqlen: int = typer.Option(512, "--seqlen", help="Calibration sample length."),
    out_dir: Path = typer.Option(Path("results/bench_zeroshot"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Zero-shot tables: pruning methods at 50% and 2:4 (Wanda's), KV policies at 20% (H2O's)."""
    from sparsegen.bench.zeroshot import bench_zeroshot

    bench_zeroshot(
        model,
        [t.strip() for t in tasks.split(",") if t.strip()] if tasks else None,
        limit or None,
        share,
        n_samples=n_samples,
        seqlen=seqlen,
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        device=device,
    )
    out.print((out_dir / "bench_zeroshot.md").read_text())


@bench_app.command("compress-prompt")
def bench_compress_prompt_command(
    model: str = ModelOpt,
    train_text: str = typer.Option("shakespeare", "--train-text", help="Text the prompt learns from (first 90%)."),
    other_text: str = typer.Option("milton", "--other-text", help="A text neither training nor tests use."),
    prompt_variant: str = typer.Option(
        "50% + int4", "--prompt-variant", help="The compression the prompt is learned on."
    ),
    steps: int = typer.Option(200, "--steps"),
    tokens: int = typer.Option(100, "--tokens"),
    lr: float = typer.Option(1e-3, "--lr"),
    seqlen: int = typer.Option(1024, "--seqlen"),
    eval_windows: int = typer.Option(16, "--eval-windows"),
    zeroshot_limit: int = typer.Option(60, "--zeroshot-limit", help="Items per zero-shot task (0 = skip zero-shot)."),
    out_dir: Path = typer.Option(Path("results/bench_compress_prompt"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Dense / compressed / compressed + soft prompt: perplexity, bits per weight, zero-shot, transfer."""
    from sparsegen.bench.compress_prompt import bench_compress_prompt

    bench_compress_prompt(
        model,
        train_text,
        other_text,
        prompt_variant,
        steps=steps,
        tokens=tokens,
        lr=lr,
        seqlen=seqlen,
        eval_windows=eval_windows,
        zeroshot_limit=zeroshot_limit or 0,
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        device=device,
    )
    out.print((out_dir / "bench_compress_prompt.md").read_text())


@bench_app.command("gather")
def bench_gather_command(
    model: str = ModelOpt,
    kept: str = typer.Option("1,0.75,0.5,0.25", "--kept", help="Shares of each projection's inputs kept."),
    passes: int = typer.Option(20, "--passes", min=1),
    out_dir: Path = typer.Option(Path("results/bench_gather"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """How fast this machine reads the weight rows of kept inputs (TEAL's gather) against the dense
    product, on the model's own projections: whether contextual sparsity can pay here."""
    from sparsegen.bench.gather import COLUMNS, bench_gather
    from sparsegen.report import markdown_table

    shares = parse_floats(kept)
    if not all(0 < share <= 1 for share in shares):
        raise SparsegenError(f"--kept takes shares in (0, 1], got {kept!r}")
    rows = bench_gather(
        model, tuple(shares), passes, out=out_dir, progress=lambda msg: err.print(f"[dim]{msg}[/]"), device=device
    )
    out.print(markdown_table(rows, COLUMNS))


@bench_app.command("contextual")
def bench_contextual_command(
    model: str = ModelOpt,
    selectors: str = typer.Option(",".join(METHODS["faster_selectors"]), "--selectors", help=SELECTOR_HELP),
    sparsities: str = typer.Option("0.5", "--sparsities"),
    batches: str = typer.Option("1", "--batches", help="Batch sizes, comma-separated."),
    context: int = typer.Option(256, "--context"),
    tokens: int = typer.Option(32, "--tokens"),
    compile: str = typer.Option(
        "never", "--compile", help="never (eager) or always: dense and sparse run the fast decode path in this mode."
    ),
    head_sparsities: str = typer.Option(
        "0", "--head-sparsities", help="Shares of attention heads skipped per token (a head predictor; not with teal)."
    ),
    engine: str = typer.Option(
        "gather", "--engine", help="How sparse MLPs run a CPU decode step: gather, fused, fused-bf16/int8/int4."
    ),
    out_dir: Path = typer.Option(Path("results/bench_contextual"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Decode ms/token of contextual sparsity vs dense, side by side, with the bytes-per-step bound."""
    from sparsegen.bench.contextual import bench_contextual

    bench_contextual(
        model,
        tuple(name.strip() for name in selectors.split(",") if name.strip()),
        tuple(parse_floats(sparsities)),
        tuple(int(b) for b in batches.split(",")),
        context,
        tokens,
        compile=compile,
        head_sparsities=tuple(parse_floats(head_sparsities)),
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        device=device,
        engine=engine,
    )
    out.print((out_dir / "bench_contextual.md").read_text())


@bench_app.command("random-model")
def bench_random_model_command(
    shape: str = typer.Option("7b", "--shape", help="Llama shape: 1b, 7b or 13b (Llama-2's sizes)."),
    tokenizer: str = typer.Option("smollm2-135m", "--tokenizer", help="Model whose tokenizer (and vocabulary) to use."),
    dtype: str = typer.Option("fp32", "--dtype", help="fp32, bf16 or fp16 (7b in fp32 is 27 GB)."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(..., "--out", help="Checkpoint folder to write."),
    device: str | None = DeviceOpt,
) -> None:
    """Write a random-weight Llama of a real shape, one block at a time (to measure the from-disk path)."""
    from transformers import AutoTokenizer

    from sparsegen.loading import tokenizer_source
    from sparsegen.models import dtype_named
    from sparsegen.random_model import write_random_llama

    loaded = AutoTokenizer.from_pretrained(tokenizer_source(tokenizer))
    folder = write_random_llama(out_dir, shape, loaded, dtype_named(dtype), seed, device=device)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e9
    out.print(f"random llama {shape} ({dtype}, vocabulary {len(loaded)}): {size:.1f} GB -> {folder}")


@bench_app.command("gpu")
def bench_gpu_command(
    shape: str = typer.Option(
        "llama3-8b",
        "--shape",
        help="Llama-3 shape built with random weights: llama3-8b, llama3.2-1b (tiny: for tests).",
    ),  # fmt: skip
    context: int = typer.Option(512, "--context", help="Prompt tokens before the batch-1 decode."),
    long_context: int = typer.Option(32768, "--long-context", help="Context of streaming and h2o against dense."),
    new_tokens: int = typer.Option(128, "--new-tokens"),
    kv_mb: float = typer.Option(16384, "--kv-mb", help="KV memory of the fixed-memory throughput comparison."),
    prompt: int = typer.Option(1024, "--prompt", help="Prompt tokens per row in that comparison."),
    sparsities: str = typer.Option("0.25,0.4,0.5", "--sparsities", help="Contextual sparsities."),
    out_dir: Path = typer.Option(Path("results/bench_gpu"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """GPU decode on real shapes (random weights): dense against the probed bandwidth, streaming and h2o at a
    long context, throughput in fixed KV memory, TEAL and neuron sparsity at batch 1 and 4, 2:4, pruning time."""
    from sparsegen.bench.gpu import bench_gpu

    bench_gpu(
        shape,
        device,
        context,
        long_context,
        new_tokens,
        kv_mb,
        prompt,
        tuple(parse_floats(sparsities)),
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
    )
    out.print((out_dir / "bench_gpu.md").read_text())


@bench_app.command("peers")
def bench_peers_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    context: int = typer.Option(1024, "--context", help="Tokens before batch-1 decoding starts."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Greedy tokens per decode measurement."),
    clients: str = typer.Option(
        "8,32", "--clients", help="Counts of concurrent clients of the servers (one alone is always measured)."
    ),
    prompt_tokens: str = typer.Option("48,128,256,384", "--prompt-tokens", help="Server prompt lengths, in turn."),
    max_tokens: int = typer.Option(48, "--max-tokens", help="Greedy tokens per server request."),
    requests: int = typer.Option(
        2,
        "--requests",
        help="Requests each client sends in turn at the largest client count; fewer clients send more each.",
    ),
    rounds: int = typer.Option(
        3,
        "--rounds",
        help="Rounds of measurements, every configuration and server in turn; each row shows its median round.",
    ),
    install: bool = typer.Option(
        False, "--install-peers", help="Make the peers' own environments with pip first (minutes, once)."
    ),
    parts: str = typer.Option(
        "decode,prompt,agreement,serve",
        "--parts",
        help="What to measure: decode (batch 1), prompt (reads), agreement (next-token choices), serve.",
    ),
    read_tokens: str = typer.Option("512,4096", "--read-tokens", help="Prompt lengths of the prompt-read rows."),
    out_dir: Path = typer.Option(Path("results/bench_peers"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """sparsegen against llama.cpp on the model's own GGUF file (batch-1 decode, prompt reads, next-token
    choices; the default model's RTN checkpoints too) and vLLM's CPU build (`sparsegen serve` with 1 and
    each count of `--clients`), every greedy answer compared."""
    from sparsegen.bench.peers.run import bench_peers

    if device not in (None, "cpu"):
        raise SparsegenError(f"bench peers compares CPU builds (llama.cpp, vLLM-CPU): use --device cpu, not {device}")

    bench_peers(
        model,
        text,
        context,
        new_tokens,
        tuple(parse_floats(clients, int)),
        tuple(parse_floats(prompt_tokens, int)),
        max_tokens,
        requests,
        install=install,
        rounds=rounds,
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
        parts=tuple(part.strip() for part in parts.split(",") if part.strip()),
        read_tokens=tuple(parse_floats(read_tokens, int)),
    )
    out.print((out_dir / "bench_peers.md").read_text())
    out.print(f"wrote {out_dir}/bench_peers.md and .json")
