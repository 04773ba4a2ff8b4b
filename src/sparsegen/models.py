"""Model structure that every capability reads: the decoder blocks, the dtype names the CLI and
lm-eval give, and the device a model runs on (the KV bytes a token takes: `kv.footprint`)."""

from __future__ import annotations

import functools
import sys

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


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of x86 CPUs that multiply bf16 natively (AVX512-BF16's dot products, AMX's tiles)."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo lists them (empty where there is none to read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return frozenset(next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), []))
    except OSError:  # not Linux: no flags to read, fp32 as before
        return frozenset()


def cpu_bf16_flag() -> str | None:
    """The flag by which this CPU computes bf16 natively (`BF16_FLAGS`), or None: bf16 matmuls then
    run emulated, slower than fp32."""
    return next((flag for flag in reversed(BF16_FLAGS) if flag in cpu_flags()), None)


def default_dtype(device: torch.device, changing_weights: bool = False) -> torch.dtype:
    """bf16 on a GPU, and on a CPU that computes bf16 natively (`cpu_bf16_flag`: half the bytes a
    step reads, prompt products several times fp32's), as vLLM chooses; fp32 on other CPUs (bf16
    matmuls without bf16 instructions measured slower), and on any CPU for weights about to change
    (`changing_weights`: pruning, quantizing, training calibrate on fp32 as before)."""
    if device.type == "cuda":
        return torch.bfloat16
    native = device.type == "cpu" and not changing_weights and cpu_bf16_flag() is not None
    return torch.bfloat16 if native else torch.float32


@functools.cache
def say_cpu_dtype(dtype: torch.dtype) -> None:
    """Say once a process which dtype a CPU load chose by default, and how to choose the other."""
    if dtype == torch.bfloat16:
        print(f"weights in bf16: this CPU computes bf16 natively ({cpu_bf16_flag()}); "
              "dtype=torch.float32 (--dtype fp32) keeps fp32", file=sys.stderr)  # fmt: skip


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
