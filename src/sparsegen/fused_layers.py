"""A decoder layer's RMSNorms and its MLP's SiLU-times-up in one pass each
(`kernels/layer_ops.cpp`), for the eager forwards of prompt reads: in bf16 PyTorch spends nine
kernels with fp32 intermediates on them, about a third of a 512-token read of the default model on a
2-core Zen 4 outside its GEMMs (docs/benchmarks.md). The values are the model's own (it rounds where
the model rounds). Only classes whose forward is known are changed (Llama, Qwen2, Mistral; Gemma's
norm adds one to its weight and its MLP is GELU: left as they are); inside a compiled graph, with
gradients on, or off the CPU, the model's own forward runs (inductor fuses its own).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from sparsegen.kernels import load_layer_ops

NORM_CLASSES = frozenset({"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"})
"""RMSNorms whose forward is `weight * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`."""
MLP_CLASSES = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})
"""MLPs whose forward is `down_proj(act_fn(gate_proj(x)) * up_proj(x))`; fused where `act_fn` is SiLU."""
FUSED_DTYPES = (torch.float32, torch.bfloat16)

Patched = list[tuple[torch.nn.Module, Callable]]
"""The modules `fuse_layers` gave a forward, each with the bound forward it gave."""


@functools.cache
def layer_ops_built() -> bool:
    """Whether the fused ops could be built here (said once on stderr where not)."""
    return load_layer_ops() is not None


def _eager_cpu(x: torch.Tensor) -> bool:
    return x.is_cpu and x.dtype in FUSED_DTYPES and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def _norm(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if _eager_cpu(x) and self.weight.dtype == x.dtype:
        return torch.ops.sparsegen.rms_norm(x, self.weight, float(self.variance_epsilon))
    return type(self).forward(self, x)


def _mlp(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not _eager_cpu(x):
        return type(self).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)
    if gate.dtype != up.dtype or gate.dtype not in FUSED_DTYPES:  # a quantized layer may hand back another dtype
        return self.down_proj(self.act_fn(gate) * up)
    return self.down_proj(torch.ops.sparsegen.silu_mul(gate, up))


def _fused_forward(module: torch.nn.Module) -> Callable | None:
    name = type(module).__name__
    if name in NORM_CLASSES and hasattr(module, "variance_epsilon"):
        return _norm
    silu = type(getattr(module, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
    return _mlp if name in MLP_CLASSES and silu else None


def fuse_layers(model: torch.nn.Module) -> Patched:
    """Give `model`'s known RMSNorms and SiLU MLPs their fused forward until `restore_layers` gets
    the returned list; modules that already have a forward of their own are left to it."""
    if not layer_ops_built():
        return []
    patched = []
    for module in model.modules():
        forward = _fused_forward(module)
        if forward is not None and "forward" not in module.__dict__:
            module.forward = types.MethodType(forward, module)
            patched.append((module, module.forward))
    return patched


def restore_layers(patched: Patched) -> None:
    """Undo `fuse_layers`: each module gets its own forward back (unless another has replaced ours since)."""
    for module, forward in patched:
        if module.__dict__.get("forward") is forward:
            del module.__dict__["forward"]


@contextmanager
def fused_layers(model: torch.nn.Module) -> Iterator[None]:
    """`fuse_layers` within the block only: the model is left as it was given."""
    patched = fuse_layers(model)
    try:
        yield
    finally:
        restore_layers(patched)
