"""Model structure that every capability reads: the decoder blocks, the KV bytes a token takes,
the dtype names the CLI and lm-eval give, and the device a model runs on."""

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


def kv_bytes_per_token(model: torch.nn.Module, dtype: torch.dtype = torch.float32, kv_bits: int | None = None) -> int:
    """Bytes one token's keys and values take over all layers, stored as `dtype` (the decoder's
    slots are fp32 by default) or in `kv_bits` (`kv.quantized`): what admission and memory
    bounds count."""
    from sparsegen.kv.quantized import codec_for

    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    codec = codec_for(kv_bits, head_dim)
    vector = head_dim * (torch.finfo(dtype).bits // 8) if codec is None else codec.width(head_dim)
    return 2 * config.num_hidden_layers * heads * vector


def kv_ring_bytes(model: torch.nn.Module, kv_bits: int | None, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the full-precision ring of newest tokens a row rounded to `kv_bits` keeps beside
    its slots (`kv.quantized.RESIDUAL` tokens in `dtype`); none at full precision."""
    from sparsegen.kv.quantized import RESIDUAL

    return 0 if kv_bits is None else RESIDUAL * kv_bytes_per_token(model, dtype)


def kv_row_bytes(model: torch.nn.Module, tokens: int, kv_bits: int | None = None) -> int:
    """Bytes of KV a row holding `tokens` takes in the decoder's slots (fp32, or `kv_bits` plus its ring)."""
    return tokens * kv_bytes_per_token(model, kv_bits=kv_bits) + kv_ring_bytes(model, kv_bits)


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
