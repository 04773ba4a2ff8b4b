"""The `sparsegen` command line: `sparsegen <verb>` and `sparsegen <capability> <verb>`."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.console import Console

from sparsegen.errors import SparsegenError

app = typer.Typer(
    help="Cheaper and longer LLM generation through sparsity.", no_args_is_help=True, pretty_exceptions_enable=False
)
bench_app = typer.Typer(help="Speed and memory benchmarks, side by side with baselines.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
out = Console()
err = Console(stderr=True)

ModelOpt = typer.Option("smollm2-135m", "--model", help="Embedded name, local folder or hub id.")
PolicyOpt = typer.Option("full", "--policy", help="KV policy: full, window, streaming, h2o, streaming_h2o.")
BudgetOpt = typer.Option(None, "--budget", help="Total KV budget in tokens (split as the policy needs).")
SinksOpt = typer.Option(None, "--sinks", help="Initial tokens always kept (streaming policies).")
RecentOpt = typer.Option(None, "--recent", help="Most recent tokens kept.")
HeavyOpt = typer.Option(None, "--heavy", help="Heavy-hitter tokens kept (h2o policies).")
PositionOpt = typer.Option(None, "--position", help="original or rolling (default: the policy's).")


def budget_parts(policy: str, budget: int | None, sinks: int | None, recent: int | None, heavy: int | None) -> dict:
    """The budget keywords for make_cache from the CLI options."""
    if policy == "full":
        return {}
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
) -> None:
    """Generate from PROMPT, streaming tokens to stdout as they are made."""
    from transformers import TextStreamer

    from sparsegen.kv import make_cache
    from sparsegen.models import load

    loaded, tokenizer = load(model)
    if chat:
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    cache = make_cache(loaded, policy, position=position, **budget_parts(policy, budget, sinks, recent, heavy))
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
    loaded.generate(
        **encoded,
        past_key_values=cache,
        max_new_tokens=max_new_tokens,
        streamer=streamer,
        pad_token_id=tokenizer.eos_token_id,
        **sampling,
    )


@app.command()
def stream(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text", help="Embedded text name or a .txt file."),
    policies: str = typer.Option("full,window,streaming,h2o,streaming_h2o", "--policies"),
    budget: int | None = typer.Option(None, "--budget", help="Total KV budget per policy [default: 1024]."),
    sinks: int | None = SinksOpt,
    recent: int | None = RecentOpt,
    heavy: int | None = HeavyOpt,
    position: str | None = PositionOpt,
    tokens: int = typer.Option(20000, "--tokens", help="Stream length in tokens."),
    chunk: int = typer.Option(64, "--chunk", help="Tokens fed per step (1 = exact token-by-token)."),
    out_dir: Path = typer.Option(Path("results/stream"), "--out"),
) -> None:
    """The main job: KV policies on one long stream past the model's window (table, plot, JSON)."""
    from sparsegen.eval.stream_job import STREAM_COLUMNS, stream_job
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
