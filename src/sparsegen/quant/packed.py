"""Linear layers whose weights stay integer: PyTorch's own weight-only kernels in the decode step.

A quantized checkpoint (or `quantize(..., pack=True)`) holds each layer as integers q, scales and
zero points with w = (q - zero) * scale per group. The layers are packed for the device they will
run on, since each kernel wants its own layout:

- int2-int4: `_weight_int4pack_mm_for_cpu` on a CPU, tinygemm's `_weight_int4pack_mm` on a CUDA
  GPU; 4 bits in nibbles, groups of 32-256 inputs, a scale and an offset per group, so any int2-int4
  grid fits exactly (a checkpoint's group of 96 becomes three of 32 sharing one scale);
- int5-int8 with one scale per output row (`--group-size 0`): `_weight_int8pack_mm` on a CPU; on a
  GPU the int8 weight is converted inside the product, which the compiled step fuses into one
  kernel reading int8, as gpt-fast does. A zero point becomes one subtraction of
  `zero * scale * sum(x)`.

The kernels take bf16 activations (the CPU's are vectorized for bf16 only: fp32 or fp16 inputs ran
5-20x slower), so a packed layer casts its input to bf16 and its output back. Layouts no kernel
takes come back as ordinary float Linears, and the caller says so once; so does a kernel whose
first product disagrees with the dequantized weight (`pack_linear`'s `verdicts`), a guard against a layout that a
PyTorch release changed.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from sparsegen.kernels import Unpacked
from sparsegen.quant.int_dot import int_dot_linear
from sparsegen.quant.linear import KERNEL_DTYPE, PackedLinear
from sparsegen.quant.quantizer import Grid, QuantScheme

INT4_GROUPS = (256, 128, 64, 32)  # group sizes the int4 kernels take, largest first
AGREEMENT = 0.02  # bf16 inputs and outputs: a kernel's product within this share of the largest output


class Int4Linear(PackedLinear):
    """int2-int4 weights, two to a byte, on the int4 kernel: (u - 8) * scale + offset per group."""

    def __init__(self, packed: torch.Tensor, scale_and_offset: torch.Tensor, group: int, in_features: int, bias=None):
        # [out, ...] packed for the CPU; [out / 8, ...] tiles for tinygemm: the scales count the outputs
        super().__init__(in_features, scale_and_offset.shape[1], bias)
        self.group = group
        self.register_buffer("packed", packed)
        self.register_buffer("scale_and_offset", scale_and_offset)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed.is_cuda:
            return torch._weight_int4pack_mm(x, self.packed, self.group, self.scale_and_offset)
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
        if self.integers.is_cuda:
            out = torch.nn.functional.linear(x, self.integers.to(x.dtype)) * self.scale
        else:
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
    verdicts: dict[type | str, Unpacked | None] | None = None,
    activation_bits: int | None = None,
) -> PackedLinear | Unpacked:
    """The packed layer for signed `integers` [out, in] with `scale` and `zero_point` [out, groups],
    packed for the integers' device, or `Unpacked`: why no kernel takes this layout (the caller then
    dequantizes).
    With `verdicts` (one dict per model), the first layer of each kernel is checked against its
    dequantized weight: a kernel that disagrees leaves every one of its layers to the float path.
    `activation_bits=8` asks for integer-dot products (`quant.int_dot`) where they take the layer;
    elsewhere the weight-only kernel, and `verdicts["integer-dot"]` records the first reason."""
    out_features, in_features = integers.shape
    group = in_features // scale.shape[1]
    device = integers.device.type
    if device not in ("cpu", "cuda"):
        return Unpacked(f"no packed kernel is wired for {device}")
    if activation_bits == 8:
        layer = int_dot_linear(integers, scale, zero_point, bits, bias)
        if not isinstance(layer, Unpacked):
            return _checked(layer, integers, scale, zero_point, verdicts)
        if verdicts is not None:
            verdicts.setdefault("integer-dot", layer)
    zero_point = zero_point.float()
    if bits <= 4:
        kernel_group = next((g for g in INT4_GROUPS if group % g == 0), None)
        if kernel_group is None:
            return Unpacked(f"int{bits} groups of {group} inputs: the int4 kernel takes multiples of 32")
        if out_features % 16:
            return Unpacked(f"{out_features} outputs: the int4 kernel takes multiples of 16")
        repeat = group // kernel_group
        group_scale = scale.float().repeat_interleave(repeat, 1)
        offset = -zero_point.repeat_interleave(repeat, 1) * group_scale
        nibbles = (integers.to(torch.int32) + 8).contiguous()
        packed = _int4_tiles(nibbles) if device == "cuda" else torch._convert_weight_to_int4pack_for_cpu(nibbles, 1)
        scale_and_offset = torch.stack([group_scale, offset], -1).transpose(0, 1).contiguous().to(KERNEL_DTYPE)
        layer = Int4Linear(packed, scale_and_offset, kernel_group, in_features, bias)
    elif scale.shape[1] != 1:
        why = f"int{bits} with {scale.shape[1]} groups a row: the int8 kernel takes one scale a row (--group-size 0)"
        return Unpacked(why)
    else:
        offset = None if not zero_point.any() else (zero_point * scale.float())[:, 0].to(KERNEL_DTYPE)
        layer = Int8Linear(integers.to(torch.int8).contiguous(), scale[:, 0].to(KERNEL_DTYPE), offset, bias)
    return _checked(layer, integers, scale, zero_point, verdicts)


def _checked(layer: PackedLinear, integers, scale, zero_point, verdicts: dict | None) -> PackedLinear | Unpacked:
    """`layer`, or why its kernel's layers stay float (`pack_linear`'s `verdicts`)."""
    if verdicts is None:
        return layer
    if type(layer) not in verdicts:
        verdicts[type(layer)] = _disagreement(layer, integers, scale, zero_point)
    return verdicts[type(layer)] or layer


def _int4_tiles(nibbles: torch.Tensor) -> torch.Tensor:
    """tinygemm's layout: two nibbles a byte (the even input high), then tiles of 16 x 16 * inner
    inputs, the inner count the largest of 8, 4, 2 that divides the row (576 inputs: 4)."""
    in_features = nibbles.shape[1]
    inner = next(tiles for tiles in (8, 4, 2) if in_features % (tiles * 16) == 0)
    pairs = (nibbles[:, ::2] << 4 | nibbles[:, 1::2]).to(torch.uint8)
    return torch._convert_weight_to_int4pack(pairs.contiguous(), inner)


def _disagreement(
    layer: PackedLinear, integers: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor
) -> Unpacked | None:
    """None when `layer`'s kernel gives the dequantized weight's product on a random input (within
    bf16 rounding), else why not."""
    x = torch.randn(2, layer.in_features, generator=torch.Generator().manual_seed(0)).to(integers.device)
    with torch.no_grad():
        expected = x @ dequantized(integers, scale, zero_point).float().T
        got = layer(x) if layer.bias is None else layer(x) - layer.bias
    error = (got.float() - expected).abs().max().item() / max(expected.abs().max().item(), 1e-6)
    if error <= AGREEMENT:
        return None
    kernel = f"the {type(layer).__name__} kernel on {integers.device.type}"
    return Unpacked(f"{kernel} disagrees with the dequantized weight (error {error:.2g})")


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
    its packed layer, on the weight's device; return {name: why} for those no kernel takes, which
    stay float."""
    unpacked, verdicts = {}, {}
    for name, grid in grids.items():
        linear = model.get_submodule(name)
        groups = linear.weight.detach().float().unflatten(1, (-1, grid.group_size))
        integers = scheme.integers(groups, grid.scale[..., None], grid.zero_point[..., None]).flatten(1)
        bias = None if linear.bias is None else linear.bias.detach()
        scale, zero_point = grid.scale.to(scheme.scale_dtype), grid.zero_point.to(torch.int8)
        layer = pack_linear(integers.to(torch.int8), scale, zero_point, scheme.bits, bias, verdicts)
        if isinstance(layer, Unpacked):
            unpacked[name] = layer.reason
        else:
            model.set_submodule(name, layer)
    return unpacked
