"""Benchmarks of memory: latency and RSS against cache size, throughput in a fixed KV memory, and
what holding KV in fewer bits costs and saves."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import DeviceOpt, ModelOpt, bench_app, err, out


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
    device: str | None = DeviceOpt,
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
        device=device,
    )
    out.print((out_dir / "bench_kv.md").read_text())
    out.print(f"wrote {out_dir}/bench_kv.md, .json, .png ({len(result['rows'])} cache sizes)")


@bench_app.command("throughput")
def bench_throughput_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    prompt: int = typer.Option(1024, "--prompt", help="Prompt tokens per row."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens generated per row."),
    kv_mb: float = typer.Option(256.0, "--kv-mb", help="KV memory budget shared by the batch, MB."),
    heavy_share: float = typer.Option(0.1, "--heavy-share", help="h2o heavy (= recent) share of the prompt."),
    max_batch: int = typer.Option(32, "--max-batch", help="Largest batch tried."),
    kv_bits: str = typer.Option("", "--kv-bits", help="Also each cache with its KV in these bits (e.g. 8,4)."),
    out_dir: Path = typer.Option(Path("results/bench_throughput"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Throughput in a fixed KV memory: the largest batch dense, h2o and streaming fit, and tokens/s."""
    from sparsegen.bench.decode import bench_throughput
    from sparsegen.kv.quantized import checked_bits

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
        device=device,
        kv_bits=tuple(checked_bits(int(b)) for b in kv_bits.split(",") if b),
    )
    out.print((out_dir / "bench_throughput.md").read_text())
    out.print(f"wrote {out_dir}/bench_throughput.md and .json")


@bench_app.command("kv-bits")
def bench_kv_bits_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    contexts: str = typer.Option("1024,8000", "--contexts", help="Tokens before decoding starts, comma-separated."),
    policies: str = typer.Option("full,streaming,h2o", "--policies"),
    kv_bits: str = typer.Option("8,4", "--kv-bits", help="Bit widths beside fp32, comma-separated."),
    cache: int = typer.Option(512, "--cache", help="Tokens the bounded policies keep."),
    new_tokens: int = typer.Option(64, "--new-tokens", help="Tokens decoded per measurement."),
    quality: bool = typer.Option(
        False, "--quality", help="Perplexity, its standard error and KL to fp32 KV, rotated and not, not speed."
    ),
    tokens: int = typer.Option(2048, "--tokens", help="With --quality: tokens of --text read."),
    chunk: int = typer.Option(16, "--chunk", help="With --quality: tokens read a forward."),
    out_dir: Path = typer.Option(Path("results/bench_kv_bits"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Decode speed and KV bytes with keys and values in fp32 and each width, per context and policy;
    with --quality, perplexity per policy and width, with and without the rotation."""
    from sparsegen.bench.kv_bits import bench_kv_bits, bench_kv_bits_quality
    from sparsegen.kv.quantized import checked_bits

    widths = tuple(checked_bits(int(b)) for b in kv_bits.split(",") if b)
    names = tuple(p for p in policies.split(",") if p)
    progress = lambda m: err.print(f"[dim]{m}[/]")  # noqa: E731
    if quality:
        bench_kv_bits_quality(model, text, tokens, names, widths, cache, chunk, out_dir, progress, device)
        name = "bench_kv_bits_quality"
    else:
        contexts_ = tuple(int(c) for c in contexts.split(",") if c)
        bench_kv_bits(
            model, text, contexts_, names, widths, cache, new_tokens, out=out_dir, progress=progress, device=device
        )
        name = "bench_kv_bits"
    out.print((out_dir / f"{name}.md").read_text())
    out.print(f"wrote {out_dir}/{name}.md and .json")
