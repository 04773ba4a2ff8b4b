"""int4 linear layers whose products are integer dot products (`activation_bits=8`).

PyTorch's weight-only int4 CPU kernel converts every weight to float and multiplies in float. Here
each input row is rounded to int8 in blocks of 32 inside the op (one fp32 step a block) and each
block of 32 weights times 32 input bytes is summed as integers, as llama.cpp's q4 x q8 products
do: `kernels/int_dot.cpp`, built on first use (`sparsegen.kernels`), one op registered with
torch's dispatcher from C++ (no Python a call) with a meta implementation, so a compiled step
keeps it as one opaque call. The weights are
repacked once, at load, into the layout the kernel reads. Where the kernel cannot be built, or a
layer's shape does not fit it, `int_dot_linear` says why and the caller keeps the weight-only layer.
"""

from __future__ import annotations

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kernels import Unpacked, load_int_dot
from sparsegen.quant.linear import PackedLinear

BLOCK = 32
MAX_ROWS = 16
"""More rows than this (a prompt being read) multiply the decoded weight in float."""
ACTIVATION_BITS = (None, 8)


def int4_linear(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """x [rows, in] fp32 times the int4 weight [out, in] held as (`nibbles`, `scales`, `mins`):
    `sparsegen::int4_linear`, registered (with its meta shape function) when the C++ is built."""
    if load_int_dot() is None:
        raise SparsegenError("the integer-dot kernels could not be built on this machine (see the message above)")
    return torch.ops.sparsegen.int4_linear(x, nibbles, scales, mins)


class IntegerDotLinear(PackedLinear):
    """A layer whose few-row products are integer dots (`integer_product`); a prompt's more than
    `float_above_rows` rows multiply the float `weight()` instead (None: the kernel at any count),
    and so does every product where `on_kernel` is False (no kernel built)."""

    float_above_rows: int | None = MAX_ROWS
    on_kernel: bool = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float().contiguous()
        many = self.float_above_rows is not None and flat.shape[0] > self.float_above_rows
        if many or not self.on_kernel:  # a prompt: a float GEMM over the weight decoded once beats row dots
            weight = self.float_weight()
            out = torch.nn.functional.linear(flat.to(weight.dtype), weight).to(x.dtype)
        else:  # the op is registered: making the layer built the kernels
            out = self.integer_product(flat).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def integer_product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight(self) -> torch.Tensor:
        raise NotImplementedError

    def float_weight(self) -> torch.Tensor:
        """The weight a prompt's float GEMM multiplies (a subclass may decode it in bf16)."""
        return self.weight()


class IntDotLinear(IntegerDotLinear):
    """int2-int4 weights as nibbles with an fp32 scale and minimum per block of 32 inputs
    (w = u * scale - min), multiplied by int8-rounded inputs."""

    def __init__(self, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bias=None) -> None:
        super().__init__(nibbles.shape[1] * 2, nibbles.shape[0], bias)
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    def integer_product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsegen.int4_linear(flat, self.nibbles, self.scales, self.mins)

    def weight(self) -> torch.Tensor:
        """The float weight [out, in] the nibbles hold."""
        pairs = self.nibbles.view(self.out_features, -1, BLOCK // 2)
        codes = torch.cat([pairs & 15, pairs >> 4], -1).float()  # [out, blocks, 32] in input order
        return (codes * self.scales[..., None] - self.mins[..., None]).flatten(1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int4 x int8 integer dot, blocks of {BLOCK}"


class Int8DotLinear(IntegerDotLinear):
    """int8 weights with an fp32 scale per block of 32 inputs (w = q * scale, llama.cpp's Q8_0),
    multiplied by int8-rounded inputs: the tied head of a packed model (`integer_head`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        super().__init__(codes.shape[1], codes.shape[0], None)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    @classmethod
    def rounded(cls, weight: torch.Tensor) -> Int8DotLinear:
        """`weight` [out, in] rounded to int8, each block of 32 inputs to its own largest magnitude."""
        if load_int_dot() is None:  # builds and registers the op the layer calls
            raise SparsegenError("the integer-dot kernels could not be built on this machine (see the message above)")
        blocks = weight.detach().float().view(weight.shape[0], -1, BLOCK)
        scales = blocks.abs().amax(-1) / 127
        codes = (blocks / scales.clamp_min(torch.finfo(torch.float32).tiny)[..., None]).round().to(torch.int8)
        return cls(codes.view_as(weight).contiguous(), scales.contiguous())

    def integer_product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.ops.sparsegen.int8_linear(flat, self.codes, self.scales)

    def weight(self) -> torch.Tensor:
        """The float weight [out, in] the codes hold."""
        blocks = self.codes.view(self.out_features, -1, BLOCK).float()
        return (blocks * self.scales[..., None]).flatten(1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, int8 x int8 integer dot, blocks of {BLOCK}"


def repack(integers: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor):
    """A grid (signed int4 `integers` [out, in], w = (q - zero) * scale per group) in the kernel's
    layout: nibbles [out, in / 2] (byte j of each block of 32: input j low, input j + 16 high,
    u = q + 8) and fp32 scales and mins [out, in / 32] (w = u * scale - min)."""
    out_features, in_features = integers.shape
    per_group = in_features // scale.shape[1] // BLOCK
    codes = (integers.to(torch.int16) + 8).to(torch.uint8).view(out_features, -1, 2, BLOCK // 2)
    nibbles = (codes[:, :, 0] | codes[:, :, 1] << 4).reshape(out_features, in_features // 2)
    scales = scale.float().repeat_interleave(per_group, 1)
    mins = (8 + zero_point.float()).repeat_interleave(per_group, 1) * scales
    return nibbles.contiguous(), scales.contiguous(), mins.contiguous()


def int_dot_linear(integers, scale, zero_point, bits: int, bias=None) -> IntDotLinear | Unpacked:
    """The integer-dot layer for a grid, or why it cannot take it."""
    out_features, in_features = integers.shape
    if bits > 4:
        return Unpacked(f"int{bits} weights: integer-dot products are written for int2-int4")
    if integers.device.type != "cpu":
        return Unpacked("integer-dot products run on a CPU")
    if in_features % (scale.shape[1] * BLOCK):
        group = in_features // scale.shape[1]
        return Unpacked(f"groups of {group} inputs: integer-dot products take multiples of {BLOCK}")
    if load_int_dot() is None:
        return Unpacked("the integer-dot kernels could not be built")
    return IntDotLinear(*repack(integers, scale, zero_point), bias)


def checked_activation_bits(bits: int | None) -> int | None:
    """`bits` if packed layers can round their inputs to that many (None: weight-only products)."""
    if bits not in ACTIVATION_BITS:
        raise SparsegenError(f"activation_bits must be 8 (integer-dot products) or None (weight-only), got {bits!r}")
    return bits


def integer_head(model: torch.nn.Module) -> Unpacked | None:
    """Give a model whose body multiplies by integer dots its output head in int8 too (the fp32
    head of a small model is most of what an int4 step reads); None, or why it keeps its head.
    A tied head becomes a layer of its own: the input embedding stays as it was."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return Unpacked("the output head is not a plain Linear")
    if head.weight.device.type != "cpu" or head.in_features % BLOCK:
        return Unpacked(f"the head needs a CPU and inputs in multiples of {BLOCK}")
    if load_int_dot() is None:
        return Unpacked("the integer-dot kernels could not be built")
    model.set_output_embeddings(Int8DotLinear.rounded(head.weight))
    model.config.tie_word_embeddings = False  # the head is its own now: nothing may tie it back
    return None
