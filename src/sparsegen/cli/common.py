"""The `sparsegen` command line: `sparsegen <verb>` and `sparsegen <capability> <verb>`."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from sparsegen.catalog import catalog
from sparsegen.errors import SparsegenError

if TYPE_CHECKING:
    from sparsegen.kv.spec import KVSpec

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

ModelOpt = typer.Option("smollm2-135m", "--model", help="Embedded name, local folder, .gguf file or hub id.")
DtypeOpt = typer.Option(
    None,
    "--dtype",
    help="Weights: fp32, bf16 or fp16 (default: bf16 on a GPU and on a CPU with AVX512-BF16 or AMX, else fp32).",
)
DeviceOpt = typer.Option(
    None, "--device", help="Where the model runs: cpu, cuda or cuda:N (default: cuda when a GPU is visible, else cpu)."
)
FromDiskOpt = typer.Option(
    None,
    "--from-disk/--in-memory",
    help="Read (and write) the model one decoder block at a time, holding one block's weights: for models "
    "larger than RAM. Default: from disk when the weights pass half of the available memory.",
)
METHODS = catalog()  # the registries' names and help, read without torch once they are cached
POLICY_HELP = f"KV policy. {METHODS['policy_help']}."
PolicyOpt = typer.Option("full", "--policy", help=POLICY_HELP)
BudgetOpt = typer.Option(None, "--budget", help="Total KV budget in tokens (split as the policy needs).")
SinksOpt = typer.Option(None, "--sinks", help="Initial tokens always kept (streaming policies).")
RecentOpt = typer.Option(None, "--recent", help="Most recent tokens kept.")
HeavyOpt = typer.Option(None, "--heavy", help="Heavy-hitter tokens kept (h2o policies).")
PositionOpt = typer.Option(None, "--position", help="original or rolling (default: the policy's).")
CompressEveryOpt = typer.Option(
    1,
    "--compress-every",
    help="Decoding steps between evictions, each evicting as many (kvpress's DecodingPress; 1: one a step).",
)
KvBitsOpt = typer.Option(
    None,
    "--kv-bits",
    help="Hold keys and values in 8, 4, 3 or 2 bits (rotated, rounded per token) [default: full precision].",
)
ActivationBitsOpt = typer.Option(
    None,
    "--activation-bits",
    help="8: an int4 checkpoint's products as integer dots, inputs rounded to int8 per block of 32 (CPU).",
)


def kv_spec(
    policy: str,
    budget: int | float | None,
    sinks: int | None = None,
    heavy: int | float | None = None,
    recent: int | float | None = None,
    position: str | None = None,
    kv_bits: int | None = None,
    compress_every: int = 1,
) -> KVSpec:
    """The KV spec from the CLI's options, built once before the model loads: a bad policy,
    conflicting budget options or bits fail at once, as one line."""
    from sparsegen.kv.spec import KVSpec

    parts = {"sinks": sinks, "heavy": heavy, "recent": recent}  # None: not given
    every = {} if compress_every == 1 else {"compress_every": compress_every}
    return KVSpec.of(policy, budget=budget, position=position, kv_bits=kv_bits, **parts, **every)


def reads_from_disk(model: str, from_disk: bool | None) -> bool:
    """--from-disk / --in-memory as given, else from disk when the weights pass half of the
    available memory (said on stderr)."""
    if from_disk is not None:
        return from_disk
    from sparsegen.scale import too_large_for_ram

    if too_large_for_ram(model):
        err.print("the weights pass half of the available memory: reading one block at a time")
        return True
    return False


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


def parse_floats(values: str, kind: type = float) -> list:
    """Comma-separated numbers of `kind`; one line naming the one that is not."""
    try:
        return [kind(v) for v in values.split(",") if v.strip()]
    except ValueError as exc:
        raise SparsegenError(f"{values!r}: {exc}; give comma-separated {kind.__name__} values") from None
