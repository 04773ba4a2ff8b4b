"""Linear products for the few rows of a decode step, where the library's own choice is far from
the memory bound: what the decode step, the sparse MLPs and TEAL's projections share."""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from contextlib import contextmanager

import torch

from sparsegen.kernels import load_float_rows
from sparsegen.models import cpu_flags

GEMV_ROWS = 4
FLOAT_ROWS_MAX = 16
"""Rows up to which eager products without packed weights go weight first (beyond, `prompt_linear`)."""
AMX_PANEL_ROWS = 3
"""Rows up to which a bf16 product over packed panels stays the kernel where AMX's tiles compute
oneDNN's GEMM; more rows are torch's GEMM, weight first (`weight @ x.T`) to 20 rows
(`kernels/float_rows.cpp`): an Intel Xeon (AMX, 2 threads), the default model's 210 layer products
with distinct (cold) weights (`scripts/few_rows_time.py --bf16`): panels 10.2 ms against 13.8 at 2
rows, 14.7 against 14.1 at 3 (15.4 against 14.3 timed in reverse: a near tie, left with the panels
until an A/B of the step says otherwise), 15.6 against 14.1 at 4, 18.7 against 14.3 at 8 (docs/benchmarks.md)."""


@functools.cache
def bf16_panel_rows() -> int | None:
    """Rows up to which a bf16 product takes the packed panels: `AMX_PANEL_ROWS` with AMX, else any
    number (None). Without AMX the panels run each row as it would run alone, so a prompt read packed
    with others gives its logits bit for bit as read alone (oneDNN past 256 rows moved them by up to
    0.375), and the server's answers do not depend on what else it serves; oneDNN was 7% faster at
    384 rows on a Zen 5, level to 10% faster on 512-row reads on a Zen 4 (docs/benchmarks.md)."""
    return AMX_PANEL_ROWS if "amx_bf16" in cpu_flags() else None


@functools.cache
def float_rows_op() -> Callable | None:
    """`sparsegen::float_rows_linear` (x [rows, in] fp32 or bf16 times a weight of the same dtype
    packed once by `sparsegen::float_rows_pack`, the weight read once for every row:
    `kernels/float_rows.cpp`, `kernels/float_rows_bf16.h`), or None where the kernel cannot be
    built (said once on stderr; the products stay torch's)."""
    if load_float_rows() is None:
        return None
    return torch.ops.sparsegen.float_rows_linear


PackedWeights = dict[torch.nn.Linear, torch.Tensor]
"""Each fp32 or bf16 CPU Linear layer's weight packed for `float_rows_linear`, by `pack_weights`."""
PACKED_DTYPES = (torch.float32, torch.bfloat16)


@torch.no_grad()
def pack_weights(model: torch.nn.Module) -> PackedWeights:
    """The model's fp32 and bf16 CPU Linear weights in the few-row kernel's panels (a copy as large
    as those weights: the layers keep theirs for their own forward and gradients), or none where the kernel
    cannot be built. A decoder packs once, at its first step, and hands the copies to every step
    (`use_gemv`, `few_row_linears`): weights changed after that are not seen by its products."""
    layers = [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.is_cpu]
    layers = [m for m in layers if m.weight.dtype in PACKED_DTYPES]
    if not layers or float_rows_op() is None:
        return {}
    return {module: torch.ops.sparsegen.float_rows_pack(module.weight.detach()) for module in layers}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, packed: torch.Tensor | None = None):
    """`F.linear` for a decode step's rows (and, over packed weights, the prompt reads between
    steps), where the library's own choice is far from the bound. On a GPU that is `F.linear`
    itself (cuBLAS streams near the bound). On a CPU, inside a compiled graph up to `GEMV_ROWS`
    rows become one multiply-and-sum over the weight rows (inductor emits a streaming reduction
    near the memory bus's speed: 2x the batch-1 `mm` kernel on this CPU). Eagerly, fp32 products
    go to the kernel over the layer's `packed` weight (`pack_weights`) at any row count (it beats
    oneDNN from 3 to 2,048 rows here, by 44% at 48: docs/benchmarks.md), bf16 ones up to
    `bf16_panel_rows()` (with AMX a longer prompt's read is oneDNN's, on AMX's tiles), unless a
    gradient is wanted. Without it, up to `FLOAT_ROWS_MAX` rows go weight first
    (`weight @ x.T`: MKL streams the weight faster that way round), more to `prompt_linear`."""
    if not x.is_cpu:
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if torch.compiler.is_compiling():
        if rows > GEMV_ROWS:
            return torch.nn.functional.linear(x, weight, bias)
        out = (x.unsqueeze(-2).float() * weight.float()).sum(-1)
        return (out if bias is None else out + bias).to(x.dtype)
    wants_gradient = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if packed is not None and wants_gradient:
        packed = None  # the kernel has no gradient
    if rows > FLOAT_ROWS_MAX and packed is None:
        return prompt_linear(x, weight, bias)
    return _row_product(x, weight, bias, rows, packed, bf16_panel_rows())


def prompt_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """A prompt read's fp32 product on a CPU through oneDNN (mkldnn), where torch has it: with
    weights read cold from memory, 20-27% faster than `F.linear`'s MKL at 128-256 rows on the AMD
    host, and a whole prompt read through the model 17% faster (docs/benchmarks.md); `F.linear`
    elsewhere, and where a gradient is wanted (the oneDNN op has none)."""
    fp32_cpu = x.is_cpu and x.dtype == weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()
    wants_gradient = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if fp32_cpu and not wants_gradient:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


def _row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, rows, packed, panel_rows):
    """The kernel over `packed` where given and x has its dtype, else weight first (`weight @ x.T`);
    neither asks anything of the row count. A bf16 product past `panel_rows` rows (`bf16_panel_rows()`,
    None: no limit) is torch's GEMM (weight first to 20 rows), chosen inside the kernel's call: a
    compiled step of any row count decides as it runs."""
    flat = x.reshape(rows, x.shape[-1])
    if packed is not None and x.dtype == packed.dtype:
        limited = packed.dtype == torch.bfloat16 and panel_rows is not None
        gemm = (weight, panel_rows) if limited else (None, -1)
        out = torch.ops.sparsegen.float_rows_linear(flat.contiguous(), packed, weight.shape[0], *gemm)
    else:
        out = (weight @ flat.T).T
    out = out.reshape(*x.shape[:-1], weight.shape[0])
    return out if bias is None else out + bias


def _forward_for(packed: torch.Tensor | None, rows_vary: bool) -> Callable:
    """The patched `forward` of a Linear layer; its `packed` weight is bound here, before any
    tracing, so a compiled graph holds the kernel as one opaque call (and the bf16 panels' row limit)."""
    panel_rows = bf16_panel_rows()

    def few_rows(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, packed)

    def any_rows(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        # `rows == 1` is decided without a guard: a free row count starts at 2 (one row is its own
        # graph); outside the graph (a prompt read between steps) `linear` picks by the row count
        if rows == 1 or not torch.compiler.is_compiling():
            return linear(x, self.weight, self.bias, packed)
        return _row_product(x, self.weight, self.bias, rows, packed, panel_rows)

    return any_rows if rows_vary else few_rows


def use_gemv(model: torch.nn.Module, rows_vary: bool = False, packed: PackedWeights | None = None) -> list:
    """Give every `nn.Linear` of `model` the decode step's few-row product (`linear`) until
    `restore_linears` gets the returned list: the compiled step's graph is traced through it.
    With `rows_vary` (one graph for every row count above one) those products are the fp32 kernel
    over the layer's `packed` weight (`pack_weights`) or weight first, which ask nothing of the
    row count. The values are `F.linear`'s (up to the order of the sums)."""
    packed = packed or {}
    patched = [m for m in model.modules() if type(m) is torch.nn.Linear and "forward" not in m.__dict__]
    for module in patched:
        module.forward = types.MethodType(_forward_for(packed.get(module), rows_vary), module)
    return patched


def restore_linears(patched: list[torch.nn.Linear]) -> None:
    """Undo `use_gemv`: the layers it changed get their own `forward` back."""
    for module in patched:
        module.__dict__.pop("forward", None)


@contextmanager
def few_row_linears(model: torch.nn.Module, packed: PackedWeights | None = None):
    """`use_gemv` for one eager step only: the model is left as it was given."""
    patched = use_gemv(model, packed=packed)
    try:
        yield
    finally:
        restore_linears(patched)
