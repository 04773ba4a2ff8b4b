"""The few-row products of a decode step: the fp32 and bf16 kernel (`float_rows_linear`) against torch."""

import pytest
import torch

from sparsegen import few_rows
from sparsegen.few_rows import AMX_PANEL_ROWS, FLOAT_ROWS_MAX, float_rows_op, linear, pack_weights


def pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.sparsegen.float_rows_pack(weight)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (7, 40), (130, 1030), (49, 16)])
def test_the_kernel_equals_the_product_in_float64(rows, out_features, in_features):
    """Every row-tile size (1-8 and a remainder), output counts off the kernel's panel width,
    inputs off its blocks of sums."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    got = float_rows_op()(x, pack(weight), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [2, 5, 8, 11, 16])
def test_a_row_comes_out_the_same_whatever_rows_share_the_call(rows):
    """What makes a batch row equal its single run: no row's sums depend on the others."""
    generator = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, 200, generator=generator), torch.randn(100, 200, generator=generator)
    together = float_rows_op()(x, pack(weight), 100)
    for row in range(rows):
        assert torch.equal(float_rows_op()(x[row : row + 1].contiguous(), pack(weight), 100)[0], together[row])


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 17, 33])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (7, 41), (130, 1029), (49, 16)])
def test_the_bf16_kernel_equals_the_product_in_float64(rows, out_features, in_features):
    """bf16 weights and rows: every row tile, odd inputs (a pair padded), outputs off the panel
    width; the float64 sum of the bf16 values, rounded once to bf16 (one ulp for the fp32 sums)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    got = float_rows_op()(x, pack(weight), out_features)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    sum_error = 1e-5 * (x.double().abs() @ weight.double().abs().T)
    assert ((got.double() - exact).abs() <= exact.abs() / 128 + sum_error).all()


def test_a_bf16_row_comes_out_the_same_whatever_rows_share_the_call():
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(11, 200, generator=generator).bfloat16(), torch.randn(100, 200, generator=generator)
    panels = pack(weight.bfloat16())
    together = float_rows_op()(x, panels, 100)
    for row in range(11):
        assert torch.equal(float_rows_op()(x[row : row + 1].contiguous(), panels, 100)[0], together[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_given_the_weight_the_kernel_leaves_more_rows_to_torchs_gemm(dtype):
    """Past `gemm_above_rows` rows the call is torch's own product bit for bit, weight first to 20
    rows (`kWeightFirstRows`), F.linear's beyond; up to it, the panels' (the same as without the
    weight): what lets a compiled step of any row count choose."""
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(40, 64, generator=generator).to(dtype)
    for rows in (3, 4, 5, 9, 20, 21, 40):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        got = float_rows_op()(x, pack(weight), 40, weight, 4)
        assert got.is_contiguous()
        if rows > 20:
            assert torch.equal(got, torch.nn.functional.linear(x, weight))
        elif rows > 4:
            assert torch.equal(got, (weight @ x.T).T)
        else:
            assert torch.equal(got, float_rows_op()(x, pack(weight), 40))
    with pytest.raises(RuntimeError, match="weight must be \\[out_features, in\\]"):
        float_rows_op()(x, pack(weight), 40, weight[:, :32], 4)


def test_a_bf16_step_compiled_for_any_rows_reads_both_sides_of_the_panel_limit(monkeypatch):
    """One compiled graph for every row count above one takes the panels at 2 rows and torch's GEMM
    at 5 (the limit set to 2 here, whatever the CPU): each row's logits within bf16's rounding of a
    plain forward of its text (a result read in the wrong layout is off by more than the logits)."""
    from sparsegen.decode import Decoder
    from sparsegen.kv.attention import policy_attention
    from tests.conftest import build_tiny

    monkeypatch.setattr(few_rows, "bf16_panel_rows", lambda: 2)
    torch._dynamo.reset()
    model = build_tiny("llama", layers=2).to(torch.bfloat16)
    ids = torch.randint(3, 90, (5, 14), generator=torch.Generator().manual_seed(5))
    decoder = Decoder(model, compile="always", rows_vary=True, notify=lambda _: None)
    for rows in (5, 2):
        with policy_attention(model):
            steps = [decoder.start(ids[:rows, :8].tolist(), 8)]
            steps += [decoder.step(ids[:rows, position]) for position in range(8, 13)]
        got = torch.stack(steps, dim=1).float()
        with torch.no_grad():
            expected = model(ids[:rows, :13]).logits[:, 7:].float()
        assert (got - expected).norm() < 0.02 * expected.norm()
    decoder.release()


def test_the_kernel_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="x must be bf16"):
        float_rows_op()(torch.randn(2, 8), pack(torch.randn(4, 8).bfloat16()), 4)
    with pytest.raises(RuntimeError, match="weight must be fp32 or bf16 \\[out, in\\]"):
        pack(torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="packed must be float_rows_pack's panels"):
        float_rows_op()(torch.randn(2, 8), pack(torch.randn(4, 6)), 4)
    with pytest.raises(RuntimeError, match="packed must be float_rows_pack's panels"):
        float_rows_op()(torch.randn(2, 8), pack(torch.randn(4, 8)), 400)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        float_rows_op()(torch.randn(2, 8, dtype=torch.float64), pack(torch.randn(4, 8)), 4)


@pytest.mark.parametrize("rows", [1, 3, FLOAT_ROWS_MAX, FLOAT_ROWS_MAX + 1, 70])
def test_linear_with_and_without_the_kernel_equals_f_linear(rows):
    """Eagerly: the kernel (or weight first) up to FLOAT_ROWS_MAX rows, `prompt_linear` (oneDNN)
    beyond; a bias added and the leading shape kept either way."""
    x, weight, bias = torch.randn(1, rows, 48), torch.randn(24, 48), torch.randn(24)
    expected = torch.nn.functional.linear(x, weight, bias)
    for packed in (pack(weight), None):
        torch.testing.assert_close(linear(x, weight, bias, packed), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", [1, AMX_PANEL_ROWS, AMX_PANEL_ROWS + 1, FLOAT_ROWS_MAX + 1, 21, 256, 257, 600])
def test_bf16_linear_takes_the_kernel_without_amx_and_onednn_for_a_prompt_with_it(rows, amx, monkeypatch):
    """bf16 rows over bf16 panels: without AMX the kernel at every row count (within a bf16 rounding
    of F.linear); with AMX the kernel only to AMX_PANEL_ROWS, then torch's GEMM (AMX's tiles) weight
    first to 20 rows, F.linear beyond."""
    monkeypatch.setattr(few_rows, "cpu_flags", lambda: frozenset({"amx_bf16"} if amx else {"avx512_bf16"}))
    few_rows.bf16_panel_rows.cache_clear()
    x, weight = torch.randn(rows, 48).bfloat16(), torch.randn(24, 48).bfloat16()
    try:
        got, expected = linear(x, weight, None, pack(weight)), torch.nn.functional.linear(x, weight)
    finally:
        few_rows.bf16_panel_rows.cache_clear()
    panel_rows = AMX_PANEL_ROWS if amx else rows
    if rows > max(panel_rows, 20):
        assert torch.equal(got, expected)
    elif rows > panel_rows:
        assert torch.equal(got, (weight @ x.T).T)
    else:
        torch.testing.assert_close(got, expected, rtol=1 / 128, atol=1e-2)


def test_without_a_compiler_the_patched_layers_keep_torch_products(monkeypatch):
    """Where the kernel cannot be built, use_gemv binds no kernel and the products are torch's."""
    from tests.conftest import build_tiny

    monkeypatch.setattr(few_rows, "float_rows_op", lambda: None)
    model = build_tiny("llama", layers=1)
    ids = torch.tensor([[3, 4, 5]])
    expected = model(ids).logits
    packed = pack_weights(model)
    patched = few_rows.use_gemv(model, rows_vary=True, packed=packed)
    try:
        assert packed == {}
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    finally:
        few_rows.restore_linears(patched)


@pytest.mark.parametrize("packed", [False, True])
def test_prompt_products_keep_their_gradient(packed):
    """Above 16 rows the product is oneDNN's, and with packed weights the kernel's at any row count;
    neither has a gradient: with one wanted it is F.linear's."""
    x, weight = torch.randn(20, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    panels = pack(weight.detach()) if packed else None
    linear(x, weight, packed=panels).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(20, 8))
    with torch.no_grad():
        torch.testing.assert_close(linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(float_rows_op() is None, reason="the few-row kernel could not be built here")
def test_without_amx_each_bf16_row_is_the_same_bit_for_bit_whatever_rows_come_with_it(monkeypatch):
    """The panels run every row as alone at any row count (none of it handed to a GEMM whose sums
    follow another order): 600 rows in one call equal them in three calls of 200, bit for bit (a
    GEMM past 256 rows moved 65-81 of these 614,400 numbers by a bf16 rounding)."""
    monkeypatch.setattr(few_rows, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    few_rows.bf16_panel_rows.cache_clear()
    generator = torch.Generator().manual_seed(0)
    x = (torch.randn(600, 576, generator=generator) * 3).bfloat16()
    weight = (torch.randn(1024, 576, generator=generator) / 24).bfloat16()
    packed = pack(weight)
    try:
        whole = linear(x, weight, None, packed)
        parts = torch.cat([linear(x[start : start + 200], weight, None, packed) for start in (0, 200, 400)])
    finally:
        few_rows.bf16_panel_rows.cache_clear()
    assert torch.equal(whole, parts)
