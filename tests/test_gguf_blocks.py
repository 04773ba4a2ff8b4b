"""The GGUF block kernels (`quant/kernels/gguf_dot.cpp`) against an independent reference: gguf's own
numpy decoder for the weight, a plain numpy rounding of the input as llama.cpp rounds it (Q8_0 per 32
with an fp16 step, Q8_K per 256 scaled by the signed largest value), and the product in float64."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sparsegen.errors import SparsegenError
from sparsegen.quant import gguf_blocks
from sparsegen.quant.gguf_blocks import KERNEL_TYPES, GGUFLinear

pytestmark = pytest.mark.skipif(not gguf_blocks.kernels_ready(), reason="the GGUF block kernels need a C++ compiler")

K_QUANTS = {GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K}


def random_blocks(qtype: GGMLQuantizationType, out: int, inputs: int, seed: int = 0) -> np.ndarray:
    """[out, row bytes] blocks: quantized by gguf where it can, else random bytes with sane fp16 scales."""
    rng = np.random.default_rng(seed)
    if qtype not in K_QUANTS:
        return quantize(rng.standard_normal((out, inputs)).astype(np.float32) * 0.05, qtype)
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (out, inputs // per_block, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-4, 2e-3, (out, inputs // per_block, 2)).astype(np.float16).view(np.uint8)
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[..., 208:210] = scales[..., :2]  # d is last
    else:
        blocks[..., 0:4] = scales  # d, dmin first
    return blocks.reshape(out, -1)


def rounded_reference(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The input as llama.cpp rounds it for `qtype`'s products, decoded to float64."""
    per_block = 256 if qtype in K_QUANTS else 32
    blocks = x.astype(np.float32).reshape(-1, per_block)
    out = np.zeros(blocks.shape, np.float64)
    for i, block in enumerate(blocks):
        if per_block == 32:
            largest = np.float32(np.abs(block).max())
            inverse = np.float32(127) / largest if largest > 0 else np.float32(0)
            codes = np.rint(block * inverse)
            step = np.float16(largest / np.float32(127)).astype(np.float64)
        else:
            signed = block[np.abs(block).argmax()]
            if signed == 0:
                continue
            inverse = np.float32(-127) / signed
            codes = np.minimum(127, np.rint(inverse * block))
            step = np.float64(np.float32(1) / inverse)
        out[i] = codes.astype(np.float64) * step
    return out.reshape(x.shape)


def kernel(x: torch.Tensor, blocks: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.ops.sparsegen.gguf_linear(x, torch.from_numpy(blocks), int(qtype), x.shape[1])


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17])
def test_product_equals_the_decoded_weight_times_the_rounded_input(qtype, rows):
    out, inputs = 24, 512
    blocks = random_blocks(qtype, out, inputs, seed=rows)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
    weight = dequantize(blocks, qtype).reshape(out, inputs).astype(np.float64)
    rounded = rounded_reference(x.numpy(), qtype)
    actual_rounding = torch.ops.sparsegen.gguf_rounded_input(x, int(qtype)).numpy()
    np.testing.assert_array_equal(actual_rounding, rounded.astype(np.float32))  # same codes, same steps
    expected = rounded @ weight.T
    bound = np.abs(rounded) @ np.abs(weight).T  # fp32 sums: error within a few ulps of this
    got = kernel(x, blocks, qtype).numpy()
    assert np.all(np.abs(got - expected) <= 2e-6 * bound + 1e-30), np.abs(got - expected).max()


@pytest.mark.parametrize("qtype", gguf_blocks.PANEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 17])
def test_panels_hold_the_same_bytes_and_their_product_equals_the_decoded_weight_times_the_rounded_input(qtype, rows):
    out, inputs = 24, 512
    blocks = torch.from_numpy(random_blocks(qtype, out, inputs, seed=rows))
    panels = torch.ops.sparsegen.gguf_panels(blocks, int(qtype), inputs, False)
    assert not torch.equal(panels, blocks)
    assert torch.equal(torch.sort(panels.flatten()).values, torch.sort(blocks.flatten()).values)  # a permutation
    assert torch.equal(torch.ops.sparsegen.gguf_panels(panels, int(qtype), inputs, True), blocks)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
    weight = dequantize(blocks.numpy(), qtype).reshape(out, inputs).astype(np.float64)
    rounded = rounded_reference(x.numpy(), qtype)
    expected, bound = rounded @ weight.T, np.abs(rounded) @ np.abs(weight).T
    got = torch.ops.sparsegen.gguf_panel_linear(x, panels, int(qtype), inputs).numpy()
    assert np.all(np.abs(got - expected) <= 2e-6 * bound + 1e-30), np.abs(got - expected).max()
    for dtype in (torch.float32, torch.bfloat16):  # a prompt's GEMM decodes the panels as the file's blocks
        decoded = torch.ops.sparsegen.gguf_panel_weight(panels, int(qtype), inputs, dtype)
        assert torch.equal(decoded, torch.ops.sparsegen.gguf_weight(blocks, int(qtype), inputs, dtype))
    layer = GGUFLinear(blocks, qtype, inputs)
    assert layer.paneled and torch.equal(layer.blocks, panels)
    assert torch.equal(layer.weight(), torch.from_numpy(weight.astype(np.float32)))


SCALE_BYTES = {  # where a block keeps its fp16 d (and dmin / m): the bytes left sane below
    GGMLQuantizationType.Q4_0: slice(0, 2),
    GGMLQuantizationType.Q4_1: slice(0, 4),
    GGMLQuantizationType.Q4_K: slice(0, 4),
    GGMLQuantizationType.Q6_K: slice(208, 210),
}


@pytest.mark.parametrize("qtype", gguf_blocks.PANEL_TYPES, ids=lambda t: t.name)
def test_panels_at_the_largest_codes_and_inputs_lose_nothing_to_narrow_sums(qtype):
    """Every code and sub-block scale at its largest (all bits set) against inputs whose rounded
    codes are all +-127: the products' partial sums at their widest (the AVX2 path adds them in int16)."""
    out, inputs = 16, 512
    per_block, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = np.full((out, inputs // per_block, block_bytes), 255, np.uint8)
    sane = random_blocks(qtype, out, inputs, seed=5).reshape(blocks.shape)
    blocks[..., SCALE_BYTES[qtype]] = sane[..., SCALE_BYTES[qtype]]
    blocks = torch.from_numpy(blocks.reshape(out, -1))
    x = torch.stack([torch.ones(inputs), -torch.ones(inputs), torch.randn(inputs).sign()])
    panels = torch.ops.sparsegen.gguf_panels(blocks, int(qtype), inputs, False)
    weight = dequantize(blocks.numpy(), qtype).reshape(out, inputs).astype(np.float64)
    rounded = rounded_reference(x.numpy(), qtype)
    assert np.abs(np.rint(rounded / np.abs(rounded).max(1, keepdims=True) * 127)).min() == 127
    expected, bound = rounded @ weight.T, np.abs(rounded) @ np.abs(weight).T
    got = torch.ops.sparsegen.gguf_panel_linear(x, panels, int(qtype), inputs).numpy()
    assert np.all(np.abs(got - expected) <= 2e-6 * bound), np.abs(got - expected).max()


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
def test_many_rows_in_several_groups_and_each_row_as_alone(qtype):
    """Rows past one L2 group (2048 inputs: 128 rows a group), and each row's bits the same alone."""
    out, inputs, rows = 10, 2048, 300
    blocks = random_blocks(qtype, out, inputs, seed=7)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(3))
    together = kernel(x, blocks, qtype)
    weight = dequantize(blocks, qtype).reshape(out, inputs).astype(np.float64)
    rounded = rounded_reference(x.numpy(), qtype)
    expected, bound = rounded @ weight.T, np.abs(rounded) @ np.abs(weight).T
    assert np.all(np.abs(together.numpy() - expected) <= 2e-6 * bound)
    for row in (0, 129, 299):
        assert torch.equal(kernel(x[row : row + 1].contiguous(), blocks, qtype)[0], together[row])


def test_a_zero_input_gives_zero():
    for qtype in KERNEL_TYPES:
        blocks = random_blocks(qtype, 4, 256)
        assert torch.equal(kernel(torch.zeros(2, 256), blocks, qtype), torch.zeros(2, 4))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q6_K], ids=lambda t: t.name)
def test_layer_runs_the_kernel_and_its_weight_is_gguf_decoded(qtype):
    blocks = random_blocks(qtype, 16, 256, seed=2)
    bias = torch.randn(16)
    layer = GGUFLinear(torch.from_numpy(blocks), qtype, 256, bias)
    x = torch.randn(2, 3, 256)
    decoded = torch.from_numpy(dequantize(blocks, qtype).reshape(16, 256))
    assert torch.equal(layer.weight(), decoded)
    close = torch.nn.functional.linear(x, decoded, bias)  # the float product: the rounding's error only
    torch.testing.assert_close(layer(x), close, rtol=0.05, atol=0.02 * close.abs().max().item())
    assert layer(x).shape == (2, 3, 16)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_the_kernels_decoder_equals_ggufs_own(qtype):
    blocks = random_blocks(qtype, 12, 512, seed=5)
    decoded = torch.from_numpy(dequantize(blocks, qtype).reshape(12, 512).astype(np.float32))
    ours = {dtype: torch.ops.sparsegen.gguf_weight(torch.from_numpy(blocks), int(qtype), 512, dtype)
            for dtype in (torch.float32, torch.bfloat16)}  # fmt: skip
    torch.testing.assert_close(ours[torch.float32], decoded, rtol=2e-7, atol=0)  # the same products, at most an ulp
    assert torch.equal(ours[torch.bfloat16], ours[torch.float32].to(torch.bfloat16))


@pytest.mark.parametrize(
    ("flag", "qtype", "bf16"),
    [
        ("amx_bf16", GGMLQuantizationType.Q4_K, True),  # AMX's tiles: the GEMM, panels or not
        ("avx512_bf16", GGMLQuantizationType.Q5_K, True),  # file-order blocks: the GEMM past the rows
        ("avx512_bf16", GGMLQuantizationType.Q4_K, False),  # panels' dots beat AVX512-BF16's GEMM
        ("avx512_bf16", GGMLQuantizationType.Q6_K, True),  # Q6_K's panels: the GEMM past the rows
        (None, GGMLQuantizationType.Q6_K, False),  # no native bf16: dots at any row count
    ],
)
def test_a_prompt_multiplies_the_blocks_decoded_to_bf16_where_that_pays(monkeypatch, flag, qtype, bf16):
    monkeypatch.setattr(gguf_blocks, "cpu_bf16_flag", lambda: flag)
    inputs = 512
    blocks = random_blocks(qtype, 24, inputs, seed=9)
    layer = GGUFLinear(torch.from_numpy(blocks), qtype, inputs)
    x = torch.randn(gguf_blocks.BF16_ABOVE_ROWS + 9, inputs, generator=torch.Generator().manual_seed(4))
    weight = torch.from_numpy(dequantize(blocks, qtype).reshape(24, inputs).astype(np.float32))
    product = torch.ops.sparsegen.gguf_panel_linear if layer.paneled else torch.ops.sparsegen.gguf_linear

    def dots(rows: torch.Tensor) -> torch.Tensor:
        return product(rows.contiguous(), layer.blocks, int(qtype), inputs)

    got, few = layer(x), layer(x[: gguf_blocks.BF16_ABOVE_ROWS])
    assert torch.equal(few, dots(x[: gguf_blocks.BF16_ABOVE_ROWS]))  # few rows: dots
    if not bf16:
        assert torch.equal(got, dots(x))
        return
    expected = x.to(torch.bfloat16).double() @ weight.to(torch.bfloat16).double().T  # bf16 inputs, exact sums
    bound = x.to(torch.bfloat16).double().abs() @ weight.to(torch.bfloat16).double().abs().T
    error = (got.double() - expected).abs()  # fp32 sums, each output rounded to bf16 (half an ulp: <= 2^-8)
    assert torch.all(error <= 2**-8 * expected.abs() + 1e-5 * bound), error.max()
    assert not torch.equal(got, dots(x))  # not the integer dots


def test_the_layer_refuses_what_it_cannot_run():
    with pytest.raises(SparsegenError, match="no block kernel"):
        GGUFLinear(torch.zeros(4, 18, dtype=torch.uint8), GGMLQuantizationType.Q2_K, 32)
    with pytest.raises(SparsegenError, match="must be uint8"):
        GGUFLinear(torch.zeros(4, 17, dtype=torch.uint8), GGMLQuantizationType.Q4_0, 32)
    with pytest.raises(SparsegenError, match="does not divide"):
        GGUFLinear(torch.zeros(4, 144, dtype=torch.uint8), GGMLQuantizationType.Q4_K, 200)
    with pytest.raises(RuntimeError, match="gguf_linear"):
        torch.ops.sparsegen.gguf_linear(torch.zeros(1, 64), torch.zeros(2, 18, dtype=torch.uint8), 2, 64)


def test_a_compiled_call_keeps_the_op_whole():
    blocks = torch.from_numpy(random_blocks(GGMLQuantizationType.Q4_K, 8, 256))
    layer = GGUFLinear(blocks, GGMLQuantizationType.Q4_K, 256)
    x = torch.randn(3, 256)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x), layer(x))


@pytest.mark.parametrize("qtype", [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K], ids=lambda t: t.name)
def test_an_embedding_decodes_the_rows_it_looks_up_and_compiles_whole(qtype):
    blocks = random_blocks(qtype, 40, 256, seed=11)
    table = torch.from_numpy(dequantize(blocks, qtype).reshape(40, 256).astype(np.float32))
    embedding = gguf_blocks.GGUFEmbedding(torch.from_numpy(blocks), qtype, 256, torch.float32)
    ids = torch.tensor([[0, 39, 7], [7, 7, 1]])
    torch.testing.assert_close(embedding(ids), table[ids], rtol=2e-7, atol=0)  # the kernel's decoder: an ulp
    assert torch.equal(embedding.weight, table)  # gguf's own decoder
    compiled = torch.compile(embedding, fullgraph=True, dynamic=False)
    assert torch.equal(compiled(ids), embedding(ids))
