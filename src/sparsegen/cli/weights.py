"""`sparsegen prune` and `sparsegen quantize`: checkpoints with fewer or smaller weights."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from sparsegen.cli.common import METHODS, DeviceOpt, FromDiskOpt, ModelOpt, app, err, out, reads_from_disk
from sparsegen.errors import SparsegenError


def _load_to_rewrite(registry, from_disk, out_dir, job, device):
    """The model with float weights (packed layers decoded), its tokenizer, calibration ids when
    the method needs them, and where its blocks live: in memory on `device` (calibrated there; on a
    GPU that cannot hold the model, in RAM and moved to the GPU one block at a time), or streamed
    from disk to `out_dir`."""
    from sparsegen.data import calibration_samples, load_text
    from sparsegen.distributed import init_from_env
    from sparsegen.layerwise_blocks import IN_MEMORY, OnDevice
    from sparsegen.loading import load, resolve_model_path
    from sparsegen.models import default_dtype, pick_device
    from sparsegen.scale import DiskBlocks, fits_on_gpu, open_lazy

    registry.named(job["method"])  # an unknown method fails before the model loads
    init_from_env()  # under torchrun: join the other ranks
    job["model"] = resolve_model_path(job["model"])
    if reads_from_disk(job["model"], from_disk):
        loaded, tokenizer, checkpoint = open_lazy(job["model"])
        if checkpoint.quantization is not None:
            raise SparsegenError(f"{job['model']} is quantized; rewrite it in memory (--in-memory)")
        blocks = DiskBlocks(loaded, checkpoint, out_dir, job)
        if blocks.finished:
            err.print(f"resuming: {len(blocks.finished)} of {blocks.count} blocks were written by an earlier run")
    elif (runs_on := pick_device(device)).type == "cuda" and not fits_on_gpu(job["model"], runs_on):
        err.print(f"the weights pass {runs_on}'s free memory: they stay in RAM, each block is rewritten on the GPU")
        loaded, tokenizer = load(job["model"], dtype=default_dtype(runs_on), packed=False, device="cpu")
        blocks = OnDevice(runs_on)
    else:
        (loaded, tokenizer), blocks = load(job["model"], packed=False, device=runs_on), IN_MEMORY
    calibration = None
    if job["calibration"]:
        text = load_text(job["calib_text"])
        calibration = calibration_samples(tokenizer, text, job["n_samples"], job["seqlen"], job["seed"])
    return loaded, tokenizer, calibration, blocks


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
    from_disk: bool | None = FromDiskOpt,
    out_dir: Path = typer.Option(..., "--out", help="Checkpoint folder to write."),
    device: str | None = DeviceOpt,
) -> None:
    """Prune a model layer by layer and write a checkpoint that transformers loads."""
    from sparsegen.distributed import is_writer, leave
    from sparsegen.prune import PRUNERS, prune
    from sparsegen.prune.checkpoint import save_pruned, sparsity_config
    from sparsegen.quant.pipeline import save_pruned_quantized

    started = time.perf_counter()
    needs_calibration = method in PRUNERS and (PRUNERS[method].needs_calibration or owl)
    job = dict(command="prune", model=model, method=method, sparsity=sparsity, pattern=pattern, owl=owl)
    job |= dict(calibration=needs_calibration, calib_text=calib_text, n_samples=n_samples, seqlen=seqlen, seed=seed)
    if compressed and from_disk:
        raise SparsegenError("--compressed stores the whole model in one file; drop it with --from-disk")
    loaded, tokenizer, calibration, blocks = _load_to_rewrite(PRUNERS, from_disk, out_dir, job, device)
    writer = is_writer()
    report = prune(loaded, method, sparsity, pattern, calibration, owl, progress=writer, blocks=blocks)
    quantized = getattr(loaded.config, "sparsegen_quantization", None)
    leave()
    if not writer:  # another rank of a torchrun writes
        return
    if blocks.writes:
        loaded.config.sparsity_config = sparsity_config(report, compressed=False)
        blocks.finish()
    elif quantized is None:
        save_pruned(loaded, tokenizer, out_dir, report, compressed=compressed)
    else:
        err.print(
            f"the input was quantized: re-quantizing the pruned weights by RTN (int{quantized['bits']}), zeros kept"
        )
        save_pruned_quantized(loaded, tokenizer, out_dir, report)
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
    from_disk: bool | None = FromDiskOpt,
    out_dir: Path = typer.Option(..., "--out", help="Checkpoint folder to write (compressed-tensors layout)."),
    device: str | None = DeviceOpt,
) -> None:
    """Quantize the decoder Linear weights (weight-only, per group), keeping pruned zeros zero."""
    from sparsegen.distributed import is_writer, leave
    from sparsegen.quant import QUANTIZERS, quantize
    from sparsegen.quant.checkpoint import finish_quantized, save_quantized
    from sparsegen.quant.size import bits_per_weight

    started = time.perf_counter()
    needs_calibration = method in QUANTIZERS and QUANTIZERS[method].needs_calibration
    job = dict(command="quantize", model=model, method=method, bits=bits, group_size=group_size, symmetric=symmetric)
    job |= dict(calibration=needs_calibration, calib_text=calib_text, n_samples=n_samples, seqlen=seqlen, seed=seed)
    loaded, tokenizer, calibration, blocks = _load_to_rewrite(QUANTIZERS, from_disk, out_dir, job, device)
    writer = is_writer()
    report = quantize(
        loaded, method, bits, group_size, symmetric, calibration=calibration, progress=writer, blocks=blocks
    )
    leave()
    if not writer:  # another rank of a torchrun writes
        return
    group_size = report.group_size
    for used in sorted({g for g in report.group_sizes.values() if g != group_size and group_size}):
        layers = sorted(name for name, g in report.group_sizes.items() if g == used)
        err.print(
            f"group size {group_size} does not divide the inputs of {len(layers)} layer(s) ({layers[0]}, ...): "
            f"used {used}, the largest divisor not above it (recorded in the checkpoint)"
        )
    if blocks.writes:
        finish_quantized(blocks, report)
        out.print(f"{method} int{bits}, one block at a time (quantizing {report.seconds:.1f} s) -> {out_dir}")
        return
    save_quantized(loaded, tokenizer, out_dir, report)
    size = bits_per_weight(loaded, report.scheme)
    sizes = ", ".join(f"{name} g{g}" for name, g in sorted(report.group_sizes.items()))
    out.print(
        f"{method} int{bits} ({'symmetric' if symmetric else 'asymmetric'}; groups: {sizes}): "
        f"{size.stored:.3f} bits/weight as stored ({16 / size.stored:.2f}x smaller than fp16), "
        f"{size.sparse_packed:.3f} with a sparsity bitmask at density {size.density:.2f} "
        f"(quantizing {report.seconds:.1f} s, total {time.perf_counter() - started:.1f} s) -> {out_dir}"
    )
