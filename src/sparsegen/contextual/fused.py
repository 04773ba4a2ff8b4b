"""The fused sparse MLP engine: Deja Vu's neuron-major storage and one kernel per MLP call.

The gathered path (`mlp.py`) reads each kept neuron's gate and up rows and its down column as
short separate streams (`embedding`, `embedding_bag`) that the prefetcher must find again, and
runs the activation as its own pass. Here the weights are repacked once, at load, into one record
per neuron (its gate row, up row and down column side by side, in fp32, bf16, or int_dot.cpp's
int8 / int4 block formats over the hidden size), and `kernels/sparse_mlp.cpp` computes
down(act(gate . x) * (up . x)) over just the kept neurons in one pass, reading each record once
for all the rows of the step. `fuse(model, engine)` gives every `SparseMLP` of a model such a
copy; a layer the kernel cannot take keeps the gathered path and says why (`Unpacked`).

The integer formats round the rows to int8 inside the kernel (as the integer-dot layers do) and
quantize every down column over the hidden size (round to nearest, one block of 32 outputs at a
time); only the decode steps' gathered calls use them: the masked path (a prompt read at once)
keeps the float weights.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from sparsegen.contextual.mlp import SparseMLP
from sparsegen.contextual.parts import MLPParts
from sparsegen.errors import SparsegenError
from sparsegen.kernels import Unpacked, load_sparse_mlp
from sparsegen.models import decoder_layers

BLOCK = 32
FORMATS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
ENGINES = ("gather", "fused", *(f"fused-{name}" for name in FORMATS))
"""How a SparseMLP computes a decode step on a CPU: `gather` (row gathers in torch), `fused` (the
kernel over fp32 weights, bf16 for a bf16 model), `fused-<format>` (the kernel over that format)."""
ACTIVATIONS = {  # the kernel's activation codes, matched by value (SiLU classes differ by version)
    0: F.silu,
    1: lambda t: F.gelu(t, approximate="tanh"),
    2: F.gelu,
    3: F.relu,
}


def activation_code(act: nn.Module) -> int | None:
    """The kernel's code for `act` (None: none of its activations), found by comparing values:
    transformers' SiLU and GELU classes change names between versions, their values do not."""
    probe = torch.linspace(-6, 6, 97)
    with torch.no_grad():
        seen = act(probe)
    return next((code for code, f in ACTIVATIONS.items() if torch.allclose(seen, f(probe), atol=1e-5)), None)


def _padded(weight: torch.Tensor, width: int) -> torch.Tensor:
    """`weight` [n, w] as fp32 [n, width], zeros on the right."""
    weight = weight.detach().float()
    return F.pad(weight, (0, width - weight.shape[1])) if width > weight.shape[1] else weight


def _int8_record(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each neuron's fp32 scales of gate, up and down per block of 32, then their int8 codes."""
    metas, codes = [], []
    for weight in rows:
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        scale = blocks.abs().amax(-1) / 127
        codes.append((blocks / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round().to(torch.int8))
        metas.append(scale)
    return _record(metas, [c.flatten(1).view(torch.uint8) for c in codes])


def _int4_record(rows: list[torch.Tensor]) -> torch.Tensor:
    """Each neuron's fp32 scale and min of gate, up and down per block of 32 (w = u * scale - min),
    then their nibbles: byte j of a block holds input j low and input j + 16 high (int_dot.py's)."""
    metas, nibbles = [], []
    for weight in rows:
        blocks = weight.view(weight.shape[0], -1, BLOCK)
        low, high = blocks.amin(-1), blocks.amax(-1)
        scale = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = ((blocks - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
        pairs = codes.view(weight.shape[0], -1, 2, BLOCK // 2)
        nibbles.append((pairs[:, :, 0] | pairs[:, :, 1] << 4).flatten(1))
        metas.append(torch.cat([scale, -low], 1))
    return _record(metas, nibbles)


def _record(metas: list[torch.Tensor], codes: list[torch.Tensor]) -> torch.Tensor:
    """One byte record a neuron: the three projections' fp32 block metadata, then their codes."""
    parts = [m.contiguous().view(torch.uint8) for m in metas] + codes
    return torch.cat(parts, 1).contiguous()


def _decode_int(packed: torch.Tensor, fmt: str, hp: int) -> list[torch.Tensor]:
    """The fp32 [neurons, hp] gate, up and down rows an integer record holds."""
    n, blocks, meta = packed.shape[0], hp // BLOCK, 2 if fmt == "int4" else 1
    floats = packed[:, : 3 * meta * blocks * 4].contiguous().view(torch.float32).view(n, 3, meta, blocks)
    codes = packed[:, 3 * meta * blocks * 4 :].view(n, 3, -1)
    if fmt == "int8":
        values = codes.view(torch.int8).float().view(n, 3, blocks, BLOCK)
        return list((values * floats[:, :, 0, :, None]).flatten(2).unbind(1))
    pairs = codes.view(n, 3, blocks, BLOCK // 2)
    values = torch.cat([pairs & 15, pairs >> 4], -1).float()
    return list((values * floats[:, :, 0, :, None] - floats[:, :, 1, :, None]).flatten(2).unbind(1))


class FusedMLP(nn.Module):
    """A gated MLP's weights as neuron records, and the kernel call over a mask of kept neurons."""

    def __init__(self, packed: torch.Tensor, fmt: str, act: int, hidden: int) -> None:
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)  # a copy of weights the model has
        self.fmt, self.act, self.hidden = fmt, act, hidden
        self.hp = -(-hidden // BLOCK) * BLOCK

    @classmethod
    def pack(cls, parts: MLPParts, fmt: str = "fp32") -> FusedMLP | Unpacked:
        """The MLP repacked neuron-major in `fmt`, or why the kernel cannot take it."""
        if fmt not in FORMATS:
            raise SparsegenError(f"no fused format {fmt!r}: one of {', '.join(FORMATS)}")
        reason = _unfusable(parts)
        if reason is not None:
            return reason
        act = activation_code(parts.act)
        if act is None:
            return Unpacked(f"the activation {type(parts.act).__name__} has no fused form (SiLU, GELU, ReLU)")
        if load_sparse_mlp() is None:
            return Unpacked("the fused sparse MLP kernel could not be built")
        hidden = parts.up.in_features
        hp = -(-hidden // BLOCK) * BLOCK
        rows = [_padded(w, hp) for w in (parts.gate.weight, parts.up.weight, parts.down.weight.t())]
        if fmt in ("fp32", "bf16"):
            packed = torch.stack(rows, 1).to(torch.float32 if fmt == "fp32" else torch.bfloat16).contiguous()
        else:
            packed = (_int8_record if fmt == "int8" else _int4_record)(rows)
        return cls(packed, fmt, act, hidden)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, gate_act: torch.Tensor | None = None) -> torch.Tensor:
        """down(act(gate x) * up x) over the neurons set in `keep` (bool [neurons]) for the rows
        x [..., hidden]; `gate_act` [rows, neurons] is act(gate x) when the caller has it. Every
        shape is the model's, whatever is kept: a compiled step holds one call of the op."""
        flat = x.reshape(-1, self.hidden).float().contiguous()
        gate = None if gate_act is None else gate_act.float().contiguous()
        out = torch.ops.sparsegen.sparse_mlp(flat, self.packed, keep, gate, FORMATS[self.fmt], self.act, self.hp)
        return out.to(x.dtype).reshape(x.shape)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fp32 gate [neurons, hidden], up [neurons, hidden] and down [hidden, neurons] the
        records hold (after rounding, for the integer formats): what the kernel multiplies by."""
        if self.fmt in ("fp32", "bf16"):
            gate, up, down = self.packed.float().unbind(1)
        else:
            gate, up, down = _decode_int(self.packed, self.fmt, self.hp)
        return gate[:, : self.hidden], up[:, : self.hidden], down[:, : self.hidden].t()

    def extra_repr(self) -> str:
        return f"{self.packed.shape[0]} neurons, {self.fmt} records, hidden {self.hidden}"


def _unfusable(parts: MLPParts) -> Unpacked | None:
    """Why the kernel cannot take these projections (None: it can)."""
    if parts.gate is None:
        return Unpacked("a plain (ungated) MLP: the kernel is written for gate/up/down")
    linears = (parts.gate, parts.up, parts.down)
    if any(type(linear) is not nn.Linear for linear in linears):
        return Unpacked("the projections are not plain Linear layers")
    if any(linear.bias is not None for linear in linears):
        return Unpacked("the projections have biases: the kernel has none")
    if any(linear.weight.device.type != "cpu" for linear in linears):
        return Unpacked("the fused kernel runs on a CPU")
    return None


def engine_format(engine: str, dtype: torch.dtype) -> str | None:
    """The record format an engine name asks for (None: `gather`), for weights of `dtype`."""
    if engine not in ENGINES:
        raise SparsegenError(f"no sparse MLP engine {engine!r}: one of {', '.join(ENGINES)}")
    if engine == "gather":
        return None
    if engine == "fused":
        return "bf16" if dtype == torch.bfloat16 else "fp32"
    return engine.removeprefix("fused-")


def fuse(model: nn.Module, engine: str = "fused", quiet: bool = False) -> list[Unpacked | None]:
    """Give every SparseMLP of `model` the engine `engine` (ENGINES); per decoder layer, None or
    why that layer keeps the gathered path (also said once on stderr unless `quiet`)."""
    reasons: list[Unpacked | None] = []
    for layer in decoder_layers(model):
        mlp = layer.mlp
        if not isinstance(mlp, SparseMLP):
            reasons.append(None)
            continue
        fmt = engine_format(engine, mlp.up.weight.dtype)
        packed = FusedMLP.pack(mlp.parts, fmt) if fmt is not None else None
        mlp.fused = packed if isinstance(packed, FusedMLP) else None
        reasons.append(packed if isinstance(packed, Unpacked) else None)
    unfused = [r for r in reasons if r is not None]
    if unfused and not quiet:
        print(f"sparsegen: {len(unfused)} MLPs keep the gathered path ({unfused[0]})", file=sys.stderr)
    return reasons
