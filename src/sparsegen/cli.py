"""The `sparsegen` command line: `sparsegen <verb>` and `sparsegen <capability> <verb>`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from sparsegen.catalog import catalog
from sparsegen.errors import SparsegenError

app = typer.Typer(
    help="Cheaper and longer LLM generation through sparsity.", no_args_is_help=True, pretty_exceptions_enable=False
)
bench_app = typer.Typer(help="Speed and memory benchmarks, side by side with baselines.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
eval_app = typer.Typer(help="Evaluation: windowed perplexity, zero-shot accuracy.", no_args_is_help=True)
app.add_typer(eval_app, name="eval")
prompt_app = typer.Typer(help="Compress, then prompt: learn and evaluate soft prompts.", no_args_is_help=True)
app.add_typer(prompt_app, name="prompt")
contextual_app = typer.Typer(
    help="Contextual sparsity: per-token MLP neurons or projection inputs.", no_args_is_help=True
)
app.add_typer(contextual_app, name="contextual")
out = Console(width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True)

ModelOpt = typer.Option("smollm2-135m", "--model", help="Embedded name, local folder or hub id.")
METHODS = catalog()  # the registries' names and help, read without torch once they are cached
POLICY_HELP = f"KV policy. {METHODS['policy_help']}."
PolicyOpt = typer.Option("full", "--policy", help=POLICY_HELP)
BudgetOpt = typer.Option(None, "--budget", help="Total KV budget in tokens (split as the policy needs).")
SinksOpt = typer.Option(None, "--sinks", help="Initial tokens always kept (streaming policies).")
RecentOpt = typer.Option(None, "--recent", help="Most recent tokens kept.")
HeavyOpt = typer.Option(None, "--heavy", help="Heavy-hitter tokens kept (h2o policies).")
PositionOpt = typer.Option(None, "--position", help="original or rolling (default: the policy's).")


def budget_parts(budget: int | None, sinks: int | None, recent: int | None, heavy: int | None) -> dict:
    """The budget keywords for make_cache from the CLI options (a total, or the parts given)."""
    parts = {k: v for k, v in (("sinks", sinks), ("recent", recent), ("heavy", heavy)) if v is not None}
    if budget is not None:
        return {"budget": budget, **({"sinks": sinks} if sinks is not None else {})}
    return parts


@app.command()
def info(model: str = ModelOpt) -> None:
    """Show the model, the cache folder and versions."""
    import torch
    import transformers

    from sparsegen import __version__
    from sparsegen.assets import cache_dir
    from sparsegen.kv import POLICIES
    from sparsegen.models import load

    loaded, tokenizer = load(model)
    config = loaded.config
    out.print(f"sparsegen {__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    out.print(f"cache folder: {cache_dir()}")
    out.print(
        f"model: {model} ({config.model_type}, {config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in loaded.parameters()) / 1e6:.1f} M parameters, "
        f"{config.max_position_embeddings} positions, attention {config._attn_implementation})"
    )
    out.print(f"KV policies: {', '.join(sorted(POLICIES))}")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The prompt text."),
    model: str = ModelOpt,
    max_new_tokens: int = typer.Option(128, "--max-new-tokens"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the model's chat template."),
    policy: str = PolicyOpt,
    budget: int | None = BudgetOpt,
    sinks: int | None = SinksOpt,
    recent: int | None = RecentOpt,
    heavy: int | None = HeavyOpt,
    position: str | None = PositionOpt,
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens with this mass."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    dtype: str = typer.Option("fp32", "--dtype", help="Weights: fp32 or bf16."),
    compile: str = typer.Option(
        "auto", "--compile", help="auto (when the generation pays for it), always, or never: the decode step."
    ),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="A soft prompt folder (peft format, from `sparsegen prompt train`) to put first."
    ),
) -> None:
    """Generate from PROMPT on the fast decode path, streaming tokens to stdout as they are made."""
    from transformers import TextStreamer

    from sparsegen.bench.decode import DTYPES
    from sparsegen.models import load

    if dtype not in DTYPES:
        raise SparsegenError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    loaded, tokenizer = load(model, dtype=DTYPES[dtype])
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    cache_options = dict(position=position, **budget_parts(budget, sinks, recent, heavy))
    held = None
    if prompt_file is not None:  # the soft prompt's KV, read once, is the row's pinned start
        from sparsegen.prompt import SoftPrompt
        from sparsegen.prompt.generate import PromptedModel

        held = [PromptedModel(loaded, SoftPrompt.load(prompt_file, loaded), policy, **cache_options).cache()]
    from sparsegen.decode import generate as fast_generate
    from sparsegen.sampling import stop_tokens

    result = fast_generate(
        loaded,
        encoded["input_ids"],
        max_new_tokens,
        held=held,
        eos_token_id=sorted(stop_tokens(loaded, tokenizer)),
        policy=policy,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        compile=compile,
        streamer=TextStreamer(tokenizer, skip_special_tokens=True),
        notify=lambda message: err.print(f"[dim]{message}[/]"),
        **cache_options,
    )
    err.print(
        f"[dim]{sum(map(len, result.tokens))} tokens, {result.tokens_per_s:.1f} tokens/s decoding ({result.mode})[/]"
    )


@app.command()
def stream(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file."),
    policies: str = typer.Option(
        ",".join(METHODS["streamable_policies"]),
        "--policies",
        help=f"Comma-separated, of {', '.join(METHODS['policies'])}; full always runs as the reference, up to the "
        "model's window.",
    ),
    budget: int | None = typer.Option(None, "--budget", help="Total KV budget per policy [default: 1024]."),
    sinks: int | None = SinksOpt,
    recent: int | None = RecentOpt,
    heavy: int | None = HeavyOpt,
    position: str | None = PositionOpt,
    tokens: int = typer.Option(20000, "--tokens", help="Stream length in tokens."),
    chunk: int = typer.Option(256, "--chunk", help="Tokens fed per step (1 = exact token-by-token)."),
    out_dir: Path = typer.Option(Path("results/stream"), "--out"),
) -> None:
    """The main job: KV policies on one long stream past the model's window (table, plot, JSON)."""
    from sparsegen.eval.main_job import STREAM_COLUMNS, stream_job
    from sparsegen.report import table

    if budget is None and sinks is None and recent is None and heavy is None:
        budget = 1024
    names = [p.strip() for p in policies.split(",") if p.strip()]
    results = stream_job(model, text, names, tokens, chunk, out_dir, budget, sinks, recent, heavy, position)
    import json

    rows = json.loads((out_dir / "results.json").read_text())
    out.print(table(list(rows.values()), STREAM_COLUMNS, title=f"{model} · {text} · chunk {chunk}"))
    out.print(
        f"wrote {out_dir}/results.json, {out_dir}/stream_nll.png and {', '.join(r.nll_file for r in results.values())}"
    )


@app.command()
def chat(
    model: str = ModelOpt,
    policy: str = typer.Option("streaming", "--policy", help=POLICY_HELP),
    budget: int | None = typer.Option(256, "--budget", help="Total KV budget in tokens."),
    sinks: int | None = SinksOpt,
    position: str | None = PositionOpt,
    mtbench: int = typer.Option(0, "--mtbench", help="Ask the first N MT-Bench turns instead of reading stdin."),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    transcript: Path | None = typer.Option(None, "--transcript", help="JSONL transcript [default: results/chat/]."),
) -> None:
    """Multi-round streaming chat with a bounded cache: MT-Bench turns, or your lines on stdin."""
    import json
    import time

    from sparsegen.bench.measure import current_rss_mb
    from sparsegen.data import load_mtbench
    from sparsegen.kv.chat import StreamingChat
    from sparsegen.models import load

    loaded, tokenizer = load(model)
    session = StreamingChat(
        loaded,
        tokenizer,
        policy,
        position=position,
        max_new_tokens=max_new_tokens,
        **budget_parts(budget, sinks, None, None),
    )
    if mtbench:
        turns = [turn for question in load_mtbench() for turn in question["turns"]][:mtbench]
    else:
        err.print("Type a message per line; Ctrl-D ends the chat.")
        turns = (line.strip() for line in sys.stdin if line.strip())
    path = transcript or Path("results/chat") / f"transcript-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as log:
        for number, turn in enumerate(turns, 1):
            out.print(f"[bold cyan]user {number}:[/] {turn}")
            out.print("[bold green]assistant:[/] ", end="")
            started = time.perf_counter()
            for piece in session.ask(turn):
                out.print(piece, end="", markup=False, highlight=False)
            out.print()
            record = {
                "turn": number,
                "user": turn,
                "assistant": session.messages[-1]["content"],
                "seconds": round(time.perf_counter() - started, 2),
                "tokens_seen": session.cache.get_seq_length(),
                "tokens_held": session.cache.physical_length(),
                "rss_mb": round(current_rss_mb(), 1),
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            err.print(
                f"[dim]tokens seen {record['tokens_seen']}, held {record['tokens_held']}, RSS {record['rss_mb']} MB[/]"
            )
    err.print(f"transcript: {path}")


@app.command()
def serve(
    model: str = ModelOpt,
    policy: str = typer.Option("streaming", "--policy", help=POLICY_HELP),
    budget: str | None = typer.Option(
        "1024", "--budget", help="KV budget per conversation: tokens (1024) or a share of each prompt (0.2)."
    ),
    sinks: int | None = SinksOpt,
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    max_kv_mb: int = typer.Option(
        1024, "--max-kv-mb", help="KV memory of every active row and held conversation (held ones dropped LRU)."
    ),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests that may wait for KV memory; more get a 429."),
    prefill_chunk: int = typer.Option(
        512, "--prefill-chunk", help="Prompt tokens read between decode steps (bounds other clients' stall)."
    ),
    max_tokens_limit: int = typer.Option(4096, "--max-tokens-limit", help="Largest max_tokens a request may ask."),
) -> None:
    """OpenAI-compatible server (chat and completions, streaming) that batches every request into one
    decode step, with a bounded KV cache per conversation (kv_policy / kv_budget per request)."""
    import uvicorn

    from sparsegen.kv.base import count_or_share
    from sparsegen.serve import build_app

    application = build_app(
        model,
        policy,
        budget_parts(count_or_share(budget), sinks, None, None),
        max_kv_bytes=max_kv_mb << 20,
        max_tokens_limit=max_tokens_limit,
        prefill_chunk=prefill_chunk,
        max_queue=max_queue,
    )
    err.print(f"serving {model} with {policy} at http://{host}:{port}/v1 (OpenAI API); Ctrl-C stops")
    uvicorn.run(application, host=host, port=port, log_level="warning")


@bench_app.command("serve")
def bench_serve_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    configs: str = typer.Option(
        "full,h2o:0.2,streaming:0.2", "--configs", help="Servers to measure: policy or policy:budget, comma-separated."
    ),
    baseline_src: Path | None = typer.Option(
        None,
        "--baseline-src",
        help="Also measure another checkout's server (its src/, policy full), e.g. an old commit's.",
    ),
    clients: str = typer.Option("1,8,24", "--clients", help="Concurrent clients, comma-separated."),
    prompt_tokens: str = typer.Option("64,256,1024", "--prompt-tokens", help="Prompt lengths, alternating."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Greedy tokens per request."),
    requests: int = typer.Option(1, "--requests", help="Requests each client sends, one after another."),
    max_kv_mb: int = typer.Option(256, "--max-kv-mb", help="The servers' KV memory (the same for every one)."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk"),
    check: bool = typer.Option(True, "--check/--no-check", help="Compare answers with single-request generate()."),
    out_dir: Path = typer.Option(Path("results/bench_serve"), "--out"),
) -> None:
    """Real HTTP clients against `sparsegen serve`: tokens/s, time to first token and inter-token
    latency, rows admitted and queued, server RSS, per configuration and number of clients."""
    from sparsegen.bench.serve import ServeConfig, bench_serve

    servers = [ServeConfig.parse(spec) for spec in configs.split(",") if spec]
    if baseline_src is not None:
        if not (baseline_src / "sparsegen").is_dir():
            raise SparsegenError(f"{baseline_src} has no sparsegen package; pass the src/ folder of a checkout")
        servers.insert(0, ServeConfig(f"baseline {baseline_src}", "full", src=baseline_src.resolve()))
    bench_serve(
        model,
        text,
        servers,
        tuple(int(c) for c in clients.split(",")),
        tuple(int(p) for p in prompt_tokens.split(",")),
        max_tokens,
        requests,
        max_kv_mb,
        prefill_chunk=prefill_chunk,
        check=check,
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
    )
    out.print((out_dir / "bench_serve.md").read_text())
    out.print(f"wrote {out_dir}/bench_serve.md, .json and two plots")


@bench_app.command("soak")
def bench_soak_command(
    model: str = ModelOpt,
    config: str = typer.Option("streaming:256", "--config", help="The server's policy or policy:budget."),
    requests: int = typer.Option(200, "--requests"),
    clients: int = typer.Option(16, "--clients"),
    max_tokens: int = typer.Option(32, "--max-tokens"),
    max_kv_mb: int = typer.Option(512, "--max-kv-mb"),
    out_dir: Path = typer.Option(Path("results/bench_soak"), "--out"),
) -> None:
    """A bounded soak of `sparsegen serve`: greedy, cancelled, malformed, too long and chat requests
    from many clients; the server's RSS along the way, rows left at the end, answers checked."""
    from sparsegen.bench.measure import run_meta
    from sparsegen.bench.serve import ServeConfig, soak
    from sparsegen.ioutil import write_json

    result = soak(
        model, ServeConfig.parse(config), requests, clients, max_tokens, max_kv_mb, progress=lambda m: err.print(m)
    )
    write_json(out_dir / "bench_soak.json", {"meta": run_meta(model=model), **result})
    for key, value in result.items():
        out.print(f"{key}: {value}")
    out.print(f"wrote {out_dir}/bench_soak.json")


@bench_app.command("kv")
def bench_kv_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    sizes: str = typer.Option("256,1024,2048", "--sizes", help="Cache sizes W, comma-separated."),
    context: int = typer.Option(4096, "--context", help="Tokens before decoding starts."),
    new_tokens: int = typer.Option(32, "--new-tokens", help="Tokens decoded per measurement."),
    stream_tokens: str = typer.Option("", "--stream-tokens", help="Also record RSS along streams of these lengths."),
    also: str = typer.Option("", "--also", help="Other policies to time at each cache size, e.g. h2o,window."),
    out_dir: Path = typer.Option(Path("results/bench_kv"), "--out"),
) -> None:
    """Per-token latency and peak RSS vs cache size: streaming, re-computation, dense."""
    from sparsegen.bench.kv import bench_kv

    result = bench_kv(
        model,
        text,
        tuple(int(s) for s in sizes.split(",")),
        context,
        new_tokens,
        stream_tokens=tuple(int(s) for s in stream_tokens.split(",") if s),
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
        also=tuple(p for p in also.split(",") if p),
    )
    out.print((out_dir / "bench_kv.md").read_text())
    out.print(f"wrote {out_dir}/bench_kv.md, .json, .png ({len(result['rows'])} cache sizes)")


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
    )
    out.print((out_dir / "bench_decode.md").read_text())
    out.print(f"wrote {out_dir}/bench_decode.md and .json")


@bench_app.command("throughput")
def bench_throughput_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    prompt: int = typer.Option(1024, "--prompt", help="Prompt tokens per row."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per row."),
    kv_mb: float = typer.Option(256.0, "--kv-mb", help="KV memory budget shared by the batch, MB."),
    heavy_share: float = typer.Option(0.1, "--heavy-share", help="h2o heavy (= recent) share of the prompt."),
    max_batch: int = typer.Option(32, "--max-batch", help="Largest batch tried."),
    out_dir: Path = typer.Option(Path("results/bench_throughput"), "--out"),
) -> None:
    """Throughput in a fixed KV memory: the largest batch dense, h2o and streaming fit, and tokens/s."""
    from sparsegen.bench.decode import bench_throughput

    bench_throughput(
        model,
        text,
        prompt,
        new_tokens,
        kv_mb,
        heavy_share,
        max_batch,
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
    )
    out.print((out_dir / "bench_throughput.md").read_text())
    out.print(f"wrote {out_dir}/bench_throughput.md and .json")


@bench_app.command("prune")
def bench_prune_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    n_samples: int = typer.Option(16, "--n-samples"),
    seqlen: int = typer.Option(512, "--seqlen"),
    sparsities: str = typer.Option("0.5,0.7,0.9", "--sparsities"),
    out_dir: Path = typer.Option(Path("results/bench_prune"), "--out"),
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
    )
    out.print((out_dir / "bench_prune.md").read_text())


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
    )
    out.print((out_dir / "prune_quality.md").read_text())


@bench_app.command("zeroshot")
def bench_zeroshot_command(
    model: str = ModelOpt,
    tasks: str = typer.Option(None, "--tasks", help="Comma-separated offline tasks [default: all eight]."),
    limit: int | None = typer.Option(100, "--limit", help="First N items of each task (0 = all)."),
    share: float = typer.Option(0.2, "--share", help="KV budget as a share of each request."),
    n_samples: int = typer.Option(32, "--n-samples", help="Calibration samples for pruning."),
    seqlen: int = typer.Option(512, "--seqlen", help="Calibration sample length."),
    out_dir: Path = typer.Option(Path("results/bench_zeroshot"), "--out"),
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
    )
    out.print((out_dir / "bench_compress_prompt.md").read_text())


SELECTOR_HELP = "; ".join(f"{name}: {summary}" for name, summary in METHODS["selectors"].items())
HeadSparsityOpt = typer.Option(
    0.0,
    "--head-sparsity",
    help="Share of attention heads skipped per token, in [0, 1), chosen by a Deja Vu head predictor trained on "
    "the calibration text (0: attention stays dense; not with teal).",
)


def registered_names(values: str, registry, what: str) -> list[str]:
    """Comma-separated names, each checked against a registry (one line naming the unknown ones)."""
    names = [name.strip() for name in values.split(",") if name.strip()]
    unknown = [name for name in names if name not in registry]
    if unknown:
        raise SparsegenError(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(sorted(registry))}")
    return names


def _floats(values: str) -> list[float]:
    return [float(v) for v in values.split(",") if v.strip()]


@contextual_app.command("measure")
def contextual_measure_command(
    model: str = ModelOpt,
    text: str = typer.Option("milton", "--text"),
    tokens: int = typer.Option(512, "--tokens", help="Tokens of the text to measure over."),
    tolerance: float = typer.Option(0.1, "--tolerance", help="Relative error of a block's output that is allowed."),
    out_dir: Path = typer.Option(Path("results/contextual_measure"), "--out"),
) -> None:
    """Does contextual sparsity exist? Neurons and heads each token needs per layer, against a static set."""
    from sparsegen.contextual.measure import measure_existence
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.models import load
    from sparsegen.report import markdown_table, plot_lines

    if not 0 < tolerance < 1:
        raise SparsegenError(f"--tolerance must be in (0, 1), got {tolerance}")
    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
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
) -> None:
    """Calibrate a selector per layer on real text (teal needs none) and save it next to a model;
    predictors report their recall per layer on held-out calibration tokens, own input and lookahead."""
    from sparsegen.contextual import save_selectors, sparsify
    from sparsegen.contextual.apply import installed_heads
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.ioutil import write_json
    from sparsegen.models import load
    from sparsegen.report import markdown_table

    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
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
    selectors: str = typer.Option("oracle,threshold,static", "--selectors", help=SELECTOR_HELP),
    sparsities: str = typer.Option("0.25,0.4,0.5,0.6", "--sparsities"),
    text: str = typer.Option("milton", "--text", help="A text the calibration does not use."),
    calib_text: str = typer.Option("shakespeare", "--calib-text"),
    seqlen: int = typer.Option(512, "--seqlen"),
    windows: int = typer.Option(8, "--windows"),
    dense_layers: int = typer.Option(0, "--dense-layers"),
    head_sparsity: float = HeadSparsityOpt,
    out_dir: Path = typer.Option(Path("results/contextual_eval"), "--out"),
) -> None:
    """Perplexity, KL and top-1 agreement against dense, per selector and sparsity (table and plot)."""
    from sparsegen.contextual.evaluate import quality_curve
    from sparsegen.data import calibration_samples, load_text, tokenize_long
    from sparsegen.ioutil import write_json, write_text
    from sparsegen.models import load
    from sparsegen.report import markdown_table, plot_lines

    names = registered_names(selectors, METHODS["selectors"], "neuron selector")
    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
    calibration = calibration_samples(tokenizer, load_text(calib_text), 8, 256)
    ids = tokenize_long(tokenizer, load_text(text))
    rows = quality_curve(
        loaded, ids, calibration, names, _floats(sparsities), seqlen, windows, dense_layers,
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


@bench_app.command("gather")
def bench_gather_command(
    model: str = ModelOpt,
    kept: str = typer.Option("1,0.75,0.5,0.25", "--kept", help="Shares of each projection's inputs kept."),
    passes: int = typer.Option(20, "--passes", min=1),
    out_dir: Path = typer.Option(Path("results/bench_gather"), "--out"),
) -> None:
    """How fast this machine reads the weight rows of kept inputs (TEAL's gather) against the dense
    product, on the model's own projections: whether contextual sparsity can pay here."""
    from sparsegen.bench.gather import COLUMNS, bench_gather
    from sparsegen.report import markdown_table

    shares = _floats(kept)
    if not all(0 < share <= 1 for share in shares):
        raise SparsegenError(f"--kept takes shares in (0, 1], got {kept!r}")
    rows = bench_gather(model, tuple(shares), passes, out=out_dir, progress=lambda msg: err.print(f"[dim]{msg}[/]"))
    out.print(markdown_table(rows, COLUMNS))


@bench_app.command("contextual")
def bench_contextual_command(
    model: str = ModelOpt,
    selectors: str = typer.Option("threshold,static", "--selectors", help=SELECTOR_HELP),
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
    out_dir: Path = typer.Option(Path("results/bench_contextual"), "--out"),
) -> None:
    """Decode ms/token of contextual sparsity vs dense, side by side, with the bytes-per-step bound."""
    from sparsegen.bench.contextual import bench_contextual

    bench_contextual(
        model,
        tuple(name.strip() for name in selectors.split(",") if name.strip()),
        tuple(_floats(sparsities)),
        tuple(int(b) for b in batches.split(",")),
        context,
        tokens,
        compile=compile,
        head_sparsities=tuple(_floats(head_sparsities)),
        out=out_dir,
        progress=lambda msg: err.print(f"[dim]{msg}[/]"),
    )
    out.print((out_dir / "bench_contextual.md").read_text())


@app.command("prune")
def prune_command(
    model: str = ModelOpt,
    method: str = typer.Option("wanda", "--method", help="Pruner: " + ", ".join(METHODS["pruners"]) + "."),
    sparsity: float = typer.Option(0.5, "--sparsity", help="Share of zeros per layer (unstructured)."),
    pattern: str = typer.Option("unstructured", "--pattern", help="unstructured, or N:M such as 2:4 or 4:8."),
    owl: bool = typer.Option(False, "--owl", help="OWL: per-layer ratios from outlier activations."),
    calib_text: str = typer.Option("shakespeare", "--calib-text", help="Embedded text name or a .txt file."),
    n_samples: int = typer.Option(
        128, "--n-samples", help="Calibration sequences (the papers' 128; 32 with --seqlen 512 runs in minutes)."
    ),
    seqlen: int = typer.Option(2048, "--seqlen", help="Tokens per calibration sequence."),
    seed: int = typer.Option(0, "--seed"),
    compressed: bool = typer.Option(False, "--compressed", help="Store bitmask-compressed weights (smaller)."),
    out_dir: Path = typer.Option(..., "--out", help="Checkpoint folder to write."),
) -> None:
    """Prune a model layer by layer and write a checkpoint that transformers loads."""
    import time

    from sparsegen.data import calibration_samples, load_text
    from sparsegen.models import load
    from sparsegen.prune import PRUNERS, prune
    from sparsegen.prune.checkpoint import save_pruned

    started = time.perf_counter()
    if method not in PRUNERS:
        raise SparsegenError(f"unknown pruning method {method!r}; choose one of: {', '.join(sorted(PRUNERS))}")
    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
    calibration = None
    if PRUNERS[method].needs_calibration or owl:
        calibration = calibration_samples(tokenizer, load_text(calib_text), n_samples, seqlen, seed)
    report = prune(loaded, method, sparsity, pattern, calibration=calibration, owl=owl)
    quantized = getattr(loaded.config, "sparsegen_quantization", None)
    if quantized is None:
        save_pruned(loaded, tokenizer, out_dir, report, compressed=compressed)
    else:
        from sparsegen.prune.checkpoint import sparsity_config
        from sparsegen.quant import quantize
        from sparsegen.quant.checkpoint import save_quantized

        err.print(
            f"the input was quantized: re-quantizing the pruned weights by RTN (int{quantized['bits']}), zeros kept"
        )
        requantized = quantize(
            loaded, "rtn", quantized["bits"], quantized["group_size"], quantized["symmetric"], progress=False
        )
        loaded.config.sparsity_config = sparsity_config(report, compressed=False)
        save_quantized(loaded, tokenizer, out_dir, requantized)
    out.print(
        f"{method} {report.pattern}: {report.overall:.2%} of decoder Linear weights are zero "
        f"(pruning {report.seconds:.1f} s, total {time.perf_counter() - started:.1f} s) -> {out_dir}"
    )


@app.command("quantize")
def quantize_command(
    model: str = ModelOpt,
    bits: int = typer.Option(4, "--bits", help="2 to 8 bits per weight."),
    group_size: int | None = typer.Option(
        None,
        "--group-size",
        help="Inputs per scale (the largest divisor of a row's inputs not above it); 0: one scale a row. "
        "Default: 128 up to 4 bits, 0 above (the layouts the CPU's int4 and int8 kernels run).",
    ),
    method: str = typer.Option("rtn", "--method", help="Quantizer: " + ", ".join(METHODS["quantizers"]) + "."),
    symmetric: bool = typer.Option(
        False, "--symmetric/--asymmetric", help="Levels around zero, or a zero point per group."
    ),
    calib_text: str = typer.Option("shakespeare", "--calib-text", help="Embedded text name or a .txt file (GPTQ)."),
    n_samples: int = typer.Option(128, "--n-samples"),
    seqlen: int = typer.Option(2048, "--seqlen"),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(..., "--out", help="Checkpoint folder to write (compressed-tensors layout)."),
) -> None:
    """Quantize the decoder Linear weights (weight-only, per group), keeping pruned zeros zero."""
    import time

    from sparsegen.data import calibration_samples, load_text
    from sparsegen.models import load
    from sparsegen.quant import QUANTIZERS, quantize
    from sparsegen.quant.checkpoint import save_quantized
    from sparsegen.quant.size import bits_per_weight

    started = time.perf_counter()
    if method not in QUANTIZERS:
        raise SparsegenError(f"unknown quantization method {method!r}; choose one of: {', '.join(sorted(QUANTIZERS))}")
    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
    calibration = None
    if QUANTIZERS[method].needs_calibration:
        calibration = calibration_samples(tokenizer, load_text(calib_text), n_samples, seqlen, seed)
    report = quantize(loaded, method, bits, group_size, symmetric, calibration=calibration)
    group_size = report.group_size
    for used in sorted({g for g in report.group_sizes.values() if g != group_size and group_size}):
        layers = sorted(name for name, g in report.group_sizes.items() if g == used)
        err.print(
            f"group size {group_size} does not divide the inputs of {len(layers)} layer(s) ({layers[0]}, ...): "
            f"used {used}, the largest divisor not above it (recorded in the checkpoint)"
        )
    save_quantized(loaded, tokenizer, out_dir, report)
    size = bits_per_weight(loaded, report.scheme)
    sizes = ", ".join(f"{name} g{g}" for name, g in sorted(report.group_sizes.items()))
    out.print(
        f"{method} int{bits} ({'symmetric' if symmetric else 'asymmetric'}; groups: {sizes}): "
        f"{size.stored:.3f} bits/weight as stored ({16 / size.stored:.2f}x smaller than fp16), "
        f"{size.sparse_packed:.3f} with a sparsity bitmask at density {size.density:.2f} "
        f"(quantizing {report.seconds:.1f} s, total {time.perf_counter() - started:.1f} s) -> {out_dir}"
    )


@prompt_app.command("train")
def prompt_train_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file to learn from."),
    tokens: int = typer.Option(100, "--tokens", help="Virtual tokens."),
    steps: int = typer.Option(200, "--steps"),
    lr: float = typer.Option(1e-3, "--lr", help="AdamW learning rate."),
    batch: int = typer.Option(1, "--batch"),
    n_samples: int = typer.Option(400, "--n-samples", help="Training samples drawn from the text."),
    seqlen: int = typer.Option(1024, "--seqlen", help="Tokens per sample."),
    distill: float = typer.Option(
        0.0, "--distill", help="Weight of the KL to --teacher's logits (0 = next-token loss)."
    ),
    teacher: str | None = typer.Option(None, "--teacher", help="The dense model to distil from."),
    seed: int = typer.Option(0, "--seed"),
    out_dir: Path = typer.Option(..., "--out", help="Prompt folder (peft format); the same command resumes it."),
) -> None:
    """Learn a soft prompt for a (compressed) model; progress bar, loss curve, resumable."""
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.models import load
    from sparsegen.prompt import PromptTraining, train_prompt

    loaded, tokenizer = load(model, packed=False)  # changes or trains on float weights
    samples = calibration_samples(tokenizer, load_text(text), n_samples, seqlen, seed)
    settings = PromptTraining(tokens=tokens, steps=steps, lr=lr, batch=batch, distill=distill, seed=seed)
    teacher_model = load(teacher)[0] if teacher else None
    _, report = train_prompt(loaded, samples, out_dir, settings, teacher=teacher_model, base_model=model)
    tail = report.losses[-min(20, len(report.losses)) :]
    out.print(
        f"{tokens} virtual tokens, {len(report.losses)} steps in {report.seconds:.0f} s; "
        f"loss {report.losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)}) -> {out_dir}"
    )


@prompt_app.command("eval")
def prompt_eval_command(
    prompt_file: Path = typer.Argument(..., help="Soft prompt folder."),
    model: str = ModelOpt,
    text: str = typer.Option("milton", "--text", help="Embedded text name or a .txt file."),
    seqlen: int = typer.Option(1024, "--seqlen"),
    max_windows: int | None = typer.Option(16, "--max-windows"),
    json_out: Path | None = typer.Option(None, "--json"),
) -> None:
    """Windowed perplexity of MODEL on TEXT without and with the soft prompt."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.ioutil import write_json
    from sparsegen.models import load
    from sparsegen.prompt import SoftPrompt, prompted_ppl

    loaded, tokenizer = load(model)
    soft = SoftPrompt.load(prompt_file, loaded)
    ids = tokenize_long(tokenizer, load_text(text))
    plain = prompted_ppl(loaded, None, ids, seqlen, max_windows)
    prompted = prompted_ppl(loaded, soft, ids, seqlen, max_windows)
    out.print(
        f"{text}, {plain.windows} windows x {seqlen}: perplexity {plain.ppl:.3f} without the prompt, "
        f"{prompted.ppl:.3f} with it"
    )
    if json_out is not None:
        write_json(
            json_out,
            {
                "model": model,
                "prompt": str(prompt_file),
                "text": text,
                "plain": plain.summary(),
                "prompted": prompted.summary(),
            },
        )


@eval_app.command("ppl")
def eval_ppl(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file."),
    seqlen: int = typer.Option(2048, "--seqlen", help="Window length (stated with every result)."),
    max_windows: int = typer.Option(
        16, "--max-windows", help="Evaluate the first N windows (minutes on a CPU); 0: the whole text."
    ),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the result as JSON here."),
) -> None:
    """Windowed perplexity: non-overlapping windows of SEQLEN, remainder dropped, exp(mean NLL)."""
    from sparsegen.data import load_text, tokenize_long
    from sparsegen.eval.perplexity import windowed_ppl
    from sparsegen.ioutil import write_json
    from sparsegen.models import load

    loaded, tokenizer = load(model)
    result = windowed_ppl(loaded, tokenize_long(tokenizer, load_text(text)), seqlen, max_windows or None)
    summary = {"model": model, "text": text, **result.summary()}
    out.print(f"perplexity {result.ppl:.3f} ({result.windows} windows x {seqlen} tokens of {text})")
    if json_out is not None:
        write_json(json_out, summary)


@eval_app.command("needle")
def eval_needle(
    model: str = ModelOpt,
    policies: str = typer.Option("full,window,streaming,h2o,snapkv,tova", "--policies", help=POLICY_HELP),
    budgets: str = typer.Option("256,1024", "--budgets", help="Total KV budgets, comma-separated."),
    length: int = typer.Option(2048, "--length", help="Context tokens (filler + needle)."),
    depths: str = typer.Option("0,0.25,0.5,0.75,1", "--depths", help="Needle depths, 0 = start of the context."),
    trials: int = typer.Option(4, "--trials", help="Passkeys (and filler offsets) per cell."),
    chunk: int | None = typer.Option(None, "--chunk", help="Read the context in pieces [default: one forward]."),
    filler: str = typer.Option("shakespeare", "--filler", help="Embedded text name or a .txt file."),
    out_dir: Path = typer.Option(Path("results/needle"), "--out"),
) -> None:
    """Passkey retrieval per policy, budget and depth, asked after the context was compressed (heat map)."""
    from sparsegen.data import load_text
    from sparsegen.eval.needle import needle_job, plot_heatmap
    from sparsegen.models import load
    from sparsegen.report import markdown_table

    names = registered_names(policies, METHODS["policies"], "KV policy")
    depth_list = [float(d) for d in depths.split(",")]
    loaded, tokenizer = load(model)
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
) -> None:
    """Zero-shot accuracy with lm-eval's prompts and metrics on offline task data (resumable)."""
    from sparsegen.eval.harness import SparsegenLM
    from sparsegen.eval.tasks import TASKS, check_tasks
    from sparsegen.eval.zeroshot import ZEROSHOT_COLUMNS, summary_rows, zeroshot_job
    from sparsegen.kv.base import count_or_share
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
    )
    summary = zeroshot_job(
        lm, names, out_dir, limit, label={"model": model}, progress=lambda msg: err.print(f"[dim]{msg}[/]")
    )
    title = f"{model} · {lm.policy}" + (f" · limit {limit}" if limit else "")
    out.print(table(summary_rows(summary), ZEROSHOT_COLUMNS, title=title))
    out.print(f"wrote {out_dir}/results.json")


def main() -> None:
    try:
        app()
    except SparsegenError as exc:
        err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted: finished work is on disk; run the same command again to resume")
        sys.exit(130)


if __name__ == "__main__":
    main()
