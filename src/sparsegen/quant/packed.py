"""Linear layers whose weights stay integer: PyTorch's own weight-only kernels in the decode step.

A quantized checkpoint (or `quantize(..., pack=True)`) holds each layer as integers q, scales and
zero points with w = (q - zero) * scale per group. Two CPU kernels take such layers as they are:

- `_weight_int4pack_mm_for_cpu`: 4 bits in nibbles, groups of 32-256 inputs, a scale and an offset
  per group, so any int2-int4 grid fits exactly (a checkpoint's group of 96 becomes three of 32
  sharing one scale);
- `_weight_int8pack_mm`: int8 with one scale per output row, so int5-int8 grids of one group a row
  (`--group-size 0`); a zero point becomes one subtraction of `zero * scale * sum(x)`.

Both are vectorized for bf16 activations only on this CPU (fp32 or fp16 inputs run 5-20x slower),
so a packed layer casts its input to bf16 and its output back. Layouts no kernel takes come back as
ordinary float Linears, and the caller says so once.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from sparsegen.quant.quantizer import Grid, QuantScheme

KERNEL_DTYPE = torch.bfloat16
INT4_GROUPS = (256, 128, 64, 32)  # group sizes the int4 kernel takes, largest first


class PackedLinear(nn.Module):
    """A Linear computed from packed integer weights: the input is cast to bf16 for the kernel."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        out = self.product(flat).to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int4Linear(PackedLinear):
    """int2-int4 weights, two to a byte, on the int4 kernel: (u - 8) * scale + offset per group."""

    def __init__(self, packed: torch.Tensor, scale_and_offset: torch.Tensor, group: int, in_features: int, bias=None):
        super().__init__(in_features, packed.shape[0], bias)
        self.group = group
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_offset", scale_and_offset)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_and_offset)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4, group={self.group}"


class Int8Linear(PackedLinear):
    """int5-int8 weights, one scale (and zero point) per output row, on the int8 kernel."""

    def __init__(self, integers: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bias=None):
        super().__init__(integers.shape[1], integers.shape[0], bias)
        self.register_buffer("integers", integers)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x, self.integers, self.scale)
        return out if self.offset is None else out - x.sum(-1, keepdim=True) * self.offset

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8, per row"


def pack_linear(
    integers: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor,
    bits: int,
    bias: torch.Tensor | None = None,
) -> PackedLinear | str:
    """The packed layer for signed `integers` [out, in] with `scale` and `zero_point` [out, groups],
    or why no kernel takes this layout (the caller then dequantizes)."""
    out_features, in_features = integers.shape
    group = in_features // scale.shape[1]
    zero_point = zero_point.float()
    if integers.device.type != "cpu":
        return f"no packed kernel is wired for {integers.device.type} yet"
    if bits <= 4:
        kernel_group = next((g for g in INT4_GROUPS if group % g == 0), None)
        if kernel_group is None:
            return f"int{bits} groups of {group} inputs: the int4 kernel takes multiples of 32"
        if out_features % 16:
            return f"{out_features} outputs: the int4 kernel takes multiples of 16"
        repeat = group // kernel_group
        scale = scale.float().repeat_interleave(repeat, 1)
        offset = -zero_point.repeat_interleave(repeat, 1) * scale
        nibbles = (integers.to(torch.int32) + 8).contiguous()
        packed = torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        scale_and_offset = torch.stack([scale, offset], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        return Int4Linear(packed, scale_and_offset, kernel_group, in_features, bias)
    if scale.shape[1] != 1:
        return f"int{bits} with {scale.shape[1]} groups a row: the int8 kernel takes one scale a row (--group-size 0)"
    offset = None if not zero_point.any() else (zero_point * scale.float())[:, 0].to(KERNEL_DTYPE)
    return Int8Linear(integers.to(torch.int8).contiguous(), scale[:, 0].to(KERNEL_DTYPE), offset, bias)


def dequantized(integers: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    """The float weight of a grid, rounded to the scales' dtype as compressed-tensors decodes it."""
    group = integers.shape[1] // scale.shape[1]
    values = (integers.float().unflatten(1, (-1, group)) - zero_point.float()[..., None]) * scale.float()[..., None]
    return values.flatten(1).to(scale.dtype)


def say_unpacked(unpacked: dict[str, str]) -> None:
    """Say once, on stderr, which layers run as floats and why (the first reason of each kind)."""
    if not unpacked:
        return
    reasons = sorted(set(unpacked.values()))
    first = next(name for name, why in unpacked.items() if why == reasons[0])
    print(
        f"{len(unpacked)} quantized layer(s) run dequantized, as floats ({first}, ...): {'; '.join(reasons)}",
        file=sys.stderr,
    )


def pack_quantized(model: nn.Module, grids: dict[str, Grid], scheme: QuantScheme) -> dict[str, str]:
    """Swap each quantized Linear of `model` (named in `grids`, holding its dequantized weight) for
    its packed layer; return {name: why} for those no kernel takes, which stay float."""
    unpacked = {}
    for name, grid in grids.items():
        linear = model.get_submodule(name)
        groups = linear.weight.detach().float().unflatten(1, (-1, grid.group_size))
        integers = scheme.integers(groups, grid.scale[..., None], grid.zero_point[..., None]).flatten(1)
        bias = None if linear.bias is None else linear.bias.detach()
        scale = grid.scale.to(scheme.scale_dtype)
        layer = pack_linear(integers.to(torch.int8), scale, grid.zero_point.to(torch.int8), scheme.bits, bias)
        if isinstance(layer, str):
            unpacked[name] = layer
        else:
            model.set_submodule(name, layer)
    return unpacked
