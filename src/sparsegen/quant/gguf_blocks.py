"""Linear layers that run a GGUF file's quantized tensors in their own block formats.

A GGUF weight is a row-major run of ggml blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 over 32 inputs;
Q4_K, Q5_K, Q6_K over 256), each block its own scales. `GGUFLinear` keeps those bytes as they are
in the file, one row of blocks per output, and multiplies them as llama.cpp's CPU products do: each
input row rounded to int8 (Q8_0 per 32 inputs for the 32-blocks, Q8_K per 256 for the K-quants)
and summed as integers against the weight's own codes (`kernels/gguf_dot.cpp`). The weights
are never dequantized and quantized again: the model is the file's model.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from sparsegen.errors import SparsegenError
from sparsegen.kernels import load_gguf_dot
from sparsegen.models import cpu_bf16_flag
from sparsegen.quant.int_dot import IntegerDotLinear

KERNEL_TYPES = tuple(
    GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
)
"""The block formats the integer-dot kernel reads; other quantized tensors are dequantized at load."""

PANEL_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q4_K", "Q6_K"))
PANEL_ROWS = 8
"""Formats repacked at load into panels of 8 output rows (`kernels/gguf_panels.h`): one integer dot
gives eight outputs' sums, one load eight rows' scales. On a Zen 4, 2 threads, a 1536 x 576 Q4_1
product went from 40 to 15 us; the file's rows made the default model's products compute-bound.
Q6_K's panels (the 1.5B's head and half its down products) gain most with several rows: the head at
8 rows 29.0 -> 18.4 ms."""
DOT_PROMPT_TYPES = tuple(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q4_K"))
"""Panels whose integer dots beat decoding the matrix for AVX512-BF16's GEMM on a prompt (Q6_K's do not:
the 1.5B's 1536 x 8960 at 512 rows took 62.3 ms against 56.4, Zen 4, 2 threads)."""


def kernels_ready() -> bool:
    """Whether the block kernels are built (and their op registered) on this machine."""
    return load_gguf_dot() is not None


def row_bytes(qtype: GGMLQuantizationType, in_features: int) -> int:
    """Bytes one output row of `in_features` inputs takes in `qtype`'s blocks."""
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    if in_features % per_block:
        raise SparsegenError(f"{qtype.name} blocks hold {per_block} inputs; a row of {in_features} does not divide")
    return in_features // per_block * block_bytes


BF16_ABOVE_ROWS = 128
"""Rows above which a CPU that computes bf16 natively multiplies a prompt by the blocks decoded to bf16
(one GEMM, after decoding the whole matrix); elsewhere the kernel takes any row count (on AVX2 it
beat decoding the blocks for an fp32 GEMM). On a Zen 5, 1 thread, the 1.5B model's 8960 x 1536
Q4_K (Q6_K) product took 6.0 (5.8) ms as integer dots at 32 rows against 19.2 (16.8) through bf16,
23.8 (22.8) against 24.3 (21.9) at 128, 49.7 (40.9) against 31.0 (28.7) at 256: decoding the
matrix (16 ms) pays only past about 128 rows, so decode steps of batched rows stay integer dots."""


def _bf16_prompts_pay(flag: str | None, dots_pay: bool) -> bool:
    """Whether a prompt's rows past `BF16_ABOVE_ROWS` go through a bf16 GEMM. The panels of
    `DOT_PROMPT_TYPES` (`dots_pay`) beat decoding the matrix for AVX512-BF16's GEMM at every row count
    measured (Zen 4, 2 threads, the 1.5B's 8960 x 1536 Q4_K at 512 rows: 32.7 ms against 46.6; Q4_1
    1536 x 576 at 2,048 rows: 7.9 against 11.5), so they take it only where AMX's tiles compute it."""
    return flag is not None and (flag == "amx_bf16" or not dots_pay)


class GGUFLinear(IntegerDotLinear):
    """A Linear whose weight is a GGUF tensor's blocks [out, row bytes] in `qtype`, run as integer dots
    (a prompt's many rows: a bf16 GEMM over the decoded blocks where the CPU computes bf16 natively)."""

    float_above_rows = None

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, in_features: int, bias=None) -> None:
        if qtype not in KERNEL_TYPES:
            raise SparsegenError(f"{qtype.name} tensors have no block kernel: formats {[t.name for t in KERNEL_TYPES]}")
        width = row_bytes(qtype, in_features)
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width:
            raise SparsegenError(f"{qtype.name} blocks for {in_features} inputs must be uint8 [out, {width}]")
        super().__init__(in_features, blocks.shape[0], bias)
        self.qtype = qtype
        self.on_kernel = kernels_ready()  # else the float weight, decoded each call (slow, exact)
        self.paneled = self.on_kernel and qtype in PANEL_TYPES and blocks.shape[0] % PANEL_ROWS == 0
        if self.on_kernel and _bf16_prompts_pay(cpu_bf16_flag(), self.paneled and qtype in DOT_PROMPT_TYPES):
            self.float_above_rows = BF16_ABOVE_ROWS
        if self.paneled:  # a repacked copy: the file's mapped pages are then never read
            blocks = torch.ops.sparsegen.gguf_panels(blocks.contiguous(), int(qtype), in_features, False)
        self.register_buffer("blocks", blocks.contiguous())

    def integer_product(self, flat: torch.Tensor) -> torch.Tensor:
        product = torch.ops.sparsegen.gguf_panel_linear if self.paneled else torch.ops.sparsegen.gguf_linear
        return product(flat, self.blocks, int(self.qtype), self.in_features)

    def file_blocks(self) -> torch.Tensor:
        """The tensor's blocks in the file's row-major order (`blocks` may hold them as panels)."""
        if not self.paneled:
            return self.blocks
        return torch.ops.sparsegen.gguf_panels(self.blocks, int(self.qtype), self.in_features, True)

    def weight(self) -> torch.Tensor:
        """The float weight [out, in] the blocks hold (gguf's own numpy decoder)."""
        return _decoded(self.file_blocks(), self.qtype, self.in_features)

    def float_weight(self) -> torch.Tensor:
        """The blocks decoded to bf16 by the kernels' own decoder (a prompt's GEMM), else `weight()`."""
        if not self.on_kernel:
            return self.weight()
        decode = torch.ops.sparsegen.gguf_panel_weight if self.paneled else torch.ops.sparsegen.gguf_weight
        return decode(self.blocks, int(self.qtype), self.in_features, torch.bfloat16)

    @classmethod
    def joined(cls, layers: list[GGUFLinear]) -> GGUFLinear:
        """One layer whose outputs are `layers`' outputs side by side, for one product where there were
        several (a small product's cost is mostly its call: the default model's q, k and v products
        took 28.9 us as three calls and 13.9 as one, Zen 3, 2 threads). Each of `layers` then holds
        its rows of the joined layer's blocks and bias (views, no second copy)."""
        first = layers[0]
        if any(
            (layer.qtype, layer.in_features, layer.paneled) != (first.qtype, first.in_features, first.paneled)
            for layer in layers
        ):
            raise SparsegenError("layers joined into one product need the same block format and input width")
        given = [layer.bias.detach() for layer in layers if layer.bias is not None]
        bias = None
        if given:  # a layer without a bias adds zeros
            parts = [given[0].new_zeros(layer.out_features) if layer.bias is None else layer.bias for layer in layers]
            bias = torch.cat(parts).detach()
        joined = cls(torch.cat([layer.file_blocks() for layer in layers]), first.qtype, first.in_features, bias)
        start = 0
        for layer in layers:
            rows = slice(start, start + layer.out_features)
            layer.blocks = joined.blocks[rows]
            if layer.bias is not None:
                layer.bias = torch.nn.Parameter(joined.bias[rows], requires_grad=False)
            start += layer.out_features
        return joined

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, GGUF {self.qtype.name} blocks x int8 integer dot"


class GGUFEmbedding(torch.nn.Module):
    """A token embedding over a GGUF tensor's blocks [vocab, row bytes]: a lookup decodes only the
    rows it reads, so the table is never held as floats (the 1.5B model's 151,936 x 1,536 Q4_K table
    is 131 MB of blocks, 933 MB in fp32). `weight` decodes the whole table for code that reads it
    (a soft prompt's initialisation), with gguf's own decoder."""

    def __init__(self, blocks: torch.Tensor, qtype: GGMLQuantizationType, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        width = row_bytes(qtype, dim)
        if qtype not in KERNEL_TYPES or blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width:
            raise SparsegenError(f"a {qtype.name} embedding of width {dim} needs uint8 blocks [vocab, {width}]")
        self.qtype, self.embedding_dim, self.num_embeddings, self.dtype = qtype, dim, blocks.shape[0], dtype
        self.on_kernel = kernels_ready()
        self.register_buffer("blocks", blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks[ids.reshape(-1)]
        if self.on_kernel:
            table = torch.ops.sparsegen.gguf_weight(rows, int(self.qtype), self.embedding_dim, torch.float32)
        else:
            table = _decoded(rows, self.qtype, self.embedding_dim)
        return table.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        return _decoded(self.blocks, self.qtype, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, GGUF {self.qtype.name} blocks, rows decoded per lookup"


def _decoded(blocks: torch.Tensor, qtype: GGMLQuantizationType, width: int) -> torch.Tensor:
    """Blocks [n, row bytes] in the file's order decoded to fp32 [n, width] by gguf's numpy decoder."""
    decoded = dequantize(blocks.cpu().numpy(), qtype).reshape(blocks.shape[0], width)
    return torch.from_numpy(np.ascontiguousarray(decoded, dtype=np.float32)).to(blocks.device)
