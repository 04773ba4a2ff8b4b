"""`sparsegen bench serve | soak | cold-start`: the server's benchmarks, real HTTP clients against it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from sparsegen.cli.common import DeviceOpt, ModelOpt, bench_app, err, out


@bench_app.command("serve")
def bench_serve_command(
    model: str = ModelOpt,
    text: str = typer.Option("shakespeare", "--text"),
    configs: str = typer.Option(
        "full,h2o:0.2,streaming:0.2",
        "--configs",
        help="Servers to measure: policy or policy:budget, @4 or @8 for KV bits (full@4), comma-separated.",
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
    device: str | None = DeviceOpt,
) -> None:
    """Real HTTP clients against `sparsegen serve`: tokens/s, time to first token and inter-token
    latency, rows admitted and queued, server RSS, per configuration and number of clients."""
    from sparsegen.bench.serve import bench_serve, configs_to_measure

    bench_serve(
        model,
        text,
        configs_to_measure(configs, baseline_src),
        tuple(int(c) for c in clients.split(",")),
        tuple(int(p) for p in prompt_tokens.split(",")),
        max_tokens,
        requests,
        max_kv_mb,
        prefill_chunk=prefill_chunk,
        check=check,
        out=out_dir,
        progress=lambda m: err.print(f"[dim]{m}[/]"),
        device=device,
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
    device: str | None = DeviceOpt,
) -> None:
    """A bounded soak of `sparsegen serve`: greedy, cancelled, malformed, too long and chat requests
    from many clients; the server's RSS along the way, rows left at the end, answers checked."""
    from sparsegen.bench.serve import ServeConfig
    from sparsegen.bench.soak import soak

    result = soak(
        model,
        ServeConfig.parse(config),
        requests,
        clients,
        max_tokens,
        max_kv_mb,
        out=out_dir,
        progress=lambda m: err.print(m),
        device=device,
    )
    for key, value in result.items():
        out.print(f"{key}: {value}")
    out.print(f"wrote {out_dir}/bench_soak.json")


@bench_app.command("cold-start")
def bench_cold_start_command(
    model: str = ModelOpt,
    configs: str = typer.Option("streaming", "--configs", help="Servers to start cold: policy or policy:budget."),
    baseline_src: Path | None = typer.Option(
        None, "--baseline-src", help="Also another checkout's server (its src/ folder), e.g. an old commit's."
    ),
    baseline_answer_only: bool = typer.Option(
        False,
        "--baseline-answer-only",
        help="Stop the baseline server after its first answer (its compile not waited).",
    ),
    out_dir: Path = typer.Option(Path("results/bench_cold_start"), "--out"),
    device: str | None = DeviceOpt,
) -> None:
    """Seconds from a first `sparsegen serve` (empty compile cache) to listening, its first answer
    and its compiled step serving."""
    from sparsegen.bench.cold_start import cold_start
    from sparsegen.bench.serve import configs_to_measure
    from sparsegen.ioutil import write_json
    from sparsegen.report import markdown_table

    servers = configs_to_measure(configs)
    if baseline_src is not None:  # the first configuration, served by the other checkout
        (checked,) = configs_to_measure("", baseline_src)
        servers.insert(0, dataclasses.replace(servers[0], label=checked.label, src=checked.src))
    options = ["--device", device] if device else []
    progress = lambda m: err.print(f"[dim]{m}[/]")  # noqa: E731
    waits = [not (baseline_src is not None and baseline_answer_only and index == 0) for index in range(len(servers))]
    rows = [
        cold_start(server, model, "Once upon a time", options, progress, wait)
        for server, wait in zip(servers, waits, strict=True)
    ]
    write_json(out_dir / "cold_start.json", {"model": model, "rows": rows})
    columns = [(key, key.replace("_", " ")) for key in rows[0]]
    out.print(markdown_table(rows, columns))
