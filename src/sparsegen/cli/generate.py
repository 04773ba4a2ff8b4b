"""Generation for people: the model's facts, text from a prompt, a stream, a chat, the server."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from sparsegen.cli.common import (
    METHODS,
    POLICY_HELP,
    ActivationBitsOpt,
    BudgetOpt,
    CompressEveryOpt,
    DeviceOpt,
    DtypeOpt,
    HeavyOpt,
    KvBitsOpt,
    ModelOpt,
    PolicyOpt,
    PositionOpt,
    RecentOpt,
    SinksOpt,
    app,
    err,
    kv_spec,
    out,
)
from sparsegen.errors import SparsegenError


@app.command()
def info(
    model: str = ModelOpt,
    device: str | None = DeviceOpt,
) -> None:
    """Show the model, the cache folder and versions."""
    import torch
    import transformers

    from sparsegen import __version__
    from sparsegen.assets import cache_dir
    from sparsegen.kv import POLICIES
    from sparsegen.loading import load

    loaded, tokenizer = load(model, device=device)
    config = loaded.config
    out.print(f"sparsegen {__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
    out.print(f"cache folder: {cache_dir()}")
    out.print(
        f"model: {model} ({config.model_type}, {config.num_hidden_layers} layers, "
        f"{sum(p.numel() for p in loaded.parameters()) / 1e6:.1f} M parameters, "
        f"{config.max_position_embeddings} positions, attention {config._attn_implementation})"
    )
    out.print(f"KV policies: {', '.join(sorted(POLICIES))}")


def _encoded(tokenizer, prompt: str, chat: bool):
    """The prompt as the model reads it: bare, or (`--chat`) a user turn in the chat template."""
    if chat:
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    return tokenizer(prompt, return_tensors="pt")


def _soft_prompt_held(prompt_file: Path, loaded, kv) -> list:
    """`--prompt-file`: the soft prompt's KV, read once, as the row's pinned start (`generate`'s `held`)."""
    from sparsegen.prompt import SoftPrompt
    from sparsegen.prompt.prompted import PromptedModel

    return [PromptedModel(loaded, SoftPrompt.load(prompt_file, loaded), kv).cache()]


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
    compress_every: int = CompressEveryOpt,
    kv_bits: int | None = KvBitsOpt,
    activation_bits: int | None = ActivationBitsOpt,
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample from the smallest set of tokens with this mass."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for sampling."),
    dtype: str | None = DtypeOpt,
    compile: str = typer.Option(
        "auto", "--compile", help="auto (when the generation pays for it), always, or never: the decode step."
    ),
    prompt_file: Path | None = typer.Option(
        None, "--prompt-file", help="A soft prompt folder (peft format, from `sparsegen prompt train`) to put first."
    ),
    device: str | None = DeviceOpt,
) -> None:
    """Generate from PROMPT on the fast decode path, streaming tokens to stdout as they are made."""
    from transformers import TextStreamer

    from sparsegen.loading import load
    from sparsegen.models import dtype_named

    kv = kv_spec(policy, budget, sinks, heavy, recent, position, kv_bits, compress_every)
    dtype = dtype_named(dtype, "--dtype") if dtype else None
    loaded, tokenizer = load(model, dtype=dtype, device=device, activation_bits=activation_bits)
    encoded = _encoded(tokenizer, prompt, chat)
    held = None if prompt_file is None else _soft_prompt_held(prompt_file, loaded, kv)
    from sparsegen.decode import generate as fast_generate

    result = fast_generate(
        loaded,
        encoded["input_ids"],
        max_new_tokens,
        kv,
        held=held,
        tokenizer=tokenizer,  # stops at its EOS and the template's turn tokens
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        compile=compile,
        streamer=TextStreamer(tokenizer, skip_special_tokens=True),
        notify=lambda message: err.print(f"[dim]{message}[/]"),
    )
    err.print(
        f"[dim]{sum(map(len, result.tokens))} tokens, {result.tokens_per_s:.1f} tokens/s decoding ({result.mode})[/]"
    )


@app.command()
def stream(
    model: str = ModelOpt,
    text: str = typer.Option(
        "shakespeare",
        "--text",
        help="Embedded text name or a .txt file; several separated by commas are read in turn, and again "
        "from the start as often as --tokens needs.",
    ),
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
    kv_bits: str = typer.Option(
        "", "--kv-bits", help="Also run each policy with its KV in these bits (e.g. 8,4), beside full precision."
    ),
    tokens: int = typer.Option(20000, "--tokens", help="Stream length in tokens."),
    chunk: int = typer.Option(256, "--chunk", help="Tokens fed per step (1 = exact token-by-token)."),
    out_dir: Path = typer.Option(Path("results/stream"), "--out"),
    device: str | None = DeviceOpt,
    against_recompute: bool = typer.Option(
        False,
        "--against-recompute",
        help="Then time a token of streaming's decode against the sliding window with re-computation, "
        "both over --budget tokens (StreamingLLM's speed claim).",
    ),
) -> None:
    """The main job: KV policies on one long stream past the model's window (table, plot, JSON)."""
    from sparsegen.eval.main_job import STREAM_COLUMNS, StreamJob, compared_specs, stream_job
    from sparsegen.report import table

    if budget is None and sinks is None and recent is None and heavy is None:
        budget = 1024
    if budget is not None and (heavy is not None or recent is not None):
        raise SparsegenError("give a total budget (--budget) or its parts (--heavy/--recent), not both")
    total = budget if budget is not None else sum(part or 0 for part in (sinks, heavy, recent))
    if not total:
        raise SparsegenError("give --budget or --sinks/--recent/--heavy")
    names = [p.strip() for p in policies.split(",") if p.strip()]
    widths = [bits.strip() for bits in kv_bits.split(",") if bits.strip()]
    if not all(bits.isdigit() for bits in widths):
        raise SparsegenError(f"--kv-bits takes bit widths separated by commas, such as 8,4; got {kv_bits!r}")
    specs = compared_specs(names, total, sinks, position, tuple(int(bits) for bits in widths))
    results = stream_job(StreamJob(model, text, specs, tokens, chunk, device), out_dir)
    import json

    rows = json.loads((out_dir / "results.json").read_text())
    out.print(table(list(rows.values()), STREAM_COLUMNS, title=f"{model} · {text} · chunk {chunk}"))
    _print_long_stream(rows, json.loads((out_dir / "meta.json").read_text()))
    if against_recompute:
        _time_against_recompute(model, text, total, device, out_dir)
    out.print(
        f"wrote {out_dir}/results.json, {out_dir}/stream_nll.png and {', '.join(r.nll_file for r in results.values())}"
    )


def _print_long_stream(rows: dict, meta: dict) -> None:
    """What a stream of millions of tokens adds to the table: the texts' passes, perplexity per
    million tokens, memory along the way and the time it took."""
    if meta["text_passes"] > 1:
        out.print(f"{meta['text']}: {meta['distinct_tokens']} distinct tokens, read {meta['text_passes']} times")
    for label, row in rows.items():
        if len(row["ppl_per_million"]) > 1:
            out.print(f"{label}: ppl per million tokens " + ", ".join(f"{p:.3f}" for p in row["ppl_per_million"]))
    samples = meta["rss_mb"]
    if samples:
        first, last = samples[0], samples[-1]
        out.print(
            f"RSS {first[1]:.0f} MB after {first[0]} tokens (peak {first[2]:.0f}), {last[1]:.0f} MB after "
            f"{last[0]} (peak {last[2]:.0f}); {meta['seconds']:.0f} s"
        )


def _time_against_recompute(model: str, text: str, window: int, device: str | None, out_dir: Path) -> None:
    """ms per token decoding through a streaming cache of `window` tokens after 4x as many, against
    a fresh forward over the last `window` tokens per token; each in a process of its own."""
    import torch

    from sparsegen.bench.kv import generate_latency, recompute_latency
    from sparsegen.bench.measure import in_process
    from sparsegen.eval.main_job import text_names
    from sparsegen.ioutil import write_json

    first = text_names(text)[0]
    threads = torch.get_num_threads()
    streaming, _ = in_process(generate_latency, model, first, 4 * window, 32, window, threads, device=device)
    recompute, _ = in_process(recompute_latency, model, first, window, 5, threads, device=device)
    timed = {"window": window, "streaming_ms": streaming, "recompute_ms": recompute, "ratio": recompute / streaming}
    write_json(out_dir / "against_recompute.json", timed)
    out.print(
        f"a token with {window} tokens held: streaming {streaming:.1f} ms, sliding window with re-computation "
        f"{recompute:.1f} ms ({recompute / streaming:.1f}x)"
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
    device: str | None = DeviceOpt,
) -> None:
    """Multi-round streaming chat with a bounded cache: MT-Bench turns, or your lines on stdin."""
    import json
    import time

    from sparsegen.data import load_mtbench
    from sparsegen.decode.chat import StreamingChat
    from sparsegen.loading import load
    from sparsegen.rss import current_rss_mb

    kv = kv_spec(policy, budget, sinks, position=position)
    loaded, tokenizer = load(model, device=device)
    session = StreamingChat(loaded, tokenizer, kv, max_new_tokens=max_new_tokens)
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
    compress_every: int = CompressEveryOpt,
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
    kv_bits: int | None = KvBitsOpt,
    activation_bits: int | None = ActivationBitsOpt,
    dtype: str | None = DtypeOpt,
    compile: bool = typer.Option(
        True,
        "--compile/--no-compile",
        help="Compile the batched decode step while serving eagerly; it takes over once built (minutes at first).",
    ),
    device: str | None = DeviceOpt,
) -> None:
    """OpenAI-compatible server (chat and completions, streaming) that batches every request into one
    decode step, with a bounded KV cache per conversation (kv_policy / kv_budget / kv_bits per request)."""
    import uvicorn

    from sparsegen.kv.policy import count_or_share
    from sparsegen.models import dtype_named
    from sparsegen.serve import build_app
    from sparsegen.serve.server import engine_first_switching

    if compile:
        err.print("answering at once with the eager step; the compiled step is built meanwhile and takes over")
    application = build_app(
        model,
        kv_spec(policy, count_or_share(budget), sinks, kv_bits=kv_bits, compress_every=compress_every),
        max_kv_bytes=max_kv_mb << 20,
        max_tokens_limit=max_tokens_limit,
        prefill_chunk=prefill_chunk,
        max_queue=max_queue,
        device=device,
        activation_bits=activation_bits,
        dtype=dtype_named(dtype, "--dtype") if dtype else None,
        compile=compile,
    )
    err.print(application.state.engine.memory.describe())
    err.print(f"serving {model} with {policy} at http://{host}:{port}/v1 (OpenAI API); Ctrl-C stops")
    with engine_first_switching():
        uvicorn.run(application, host=host, port=port, log_level="warning")
