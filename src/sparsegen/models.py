"""Model structure that every capability reads: the decoder blocks, the dtype names the CLI and
lm-eval give, and the device a model runs on (the KV bytes a token takes: `kv.footprint`)."""

from __future__ import annotations

import torch

from sparsegen.errors import SparsegenError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_TORCH_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DEVICES = "cpu, cuda or cuda:N"


def pick_device(device: str | torch.device | None = None) -> torch.device:
    """`device` as given, checked, else cuda when a GPU is visible, else cpu."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        chosen = torch.device(device)
    except (RuntimeError, TypeError):
        raise SparsegenError(f"unknown device {device!r}: use {DEVICES}") from None
    if chosen.type not in ("cpu", "cuda", "meta"):
        raise SparsegenError(f"device {device!r} is not supported: use {DEVICES}")
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise SparsegenError(f"device {device!r}: no CUDA GPU is visible to this PyTorch; use --device cpu")
    if chosen.type == "cuda" and (chosen.index or 0) >= torch.cuda.device_count():
        raise SparsegenError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) are visible")
    return chosen


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (half the bytes a step reads, at full speed), fp32 on a CPU (where bf16
    matmuls without bf16 instructions measured slower)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's (first materialized) weights."""
    return next((p.device for p in model.parameters() if not p.is_meta), torch.device("cpu"))


def dtype_named(name: str, option: str = "dtype") -> torch.dtype:
    """A dtype by its short name (fp32, bf16, fp16) or torch's (float32, bfloat16, float16), as the
    CLI and lm-eval's `dtype=` give them."""
    short = _TORCH_DTYPE_NAMES.get(name, name)
    if short not in DTYPES:
        raise SparsegenError(f"{option} must be one of {', '.join(DTYPES)} (or torch's names), got {name!r}")
    return DTYPES[short]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The model's decoder blocks (`model.model.layers` in transformers' decoders)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) == 0:
        raise SparsegenError(
            f"{type(model).__name__}: no decoder layers found (expected model.model.layers); "
            "sparsegen supports transformers decoder-only language models"
        )
    return layers


def require_float_linears(model: torch.nn.Module, doing: str) -> None:
    """Stop before `doing` something that needs float weights (pruning, training) on a model whose
    decoder holds packed integer layers (`quant.packed`: their weights are integer buffers)."""
    if any(not buffer.is_floating_point() for buffer in decoder_layers(model).buffers()):
        raise SparsegenError(
            f"cannot {doing}: this model's Linear layers are packed integers; load it with "
            "sparsegen.load(DIR, packed=False) (the CLI does for commands that change weights)"
        )
