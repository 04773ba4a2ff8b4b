"""The few-row products of a decode step: the fp32 kernel (`float_rows_linear`) against torch."""

import pytest
import torch

from sparsegen import few_rows
from sparsegen.few_rows import FLOAT_ROWS_MAX, float_rows_op, linear


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17])
@pytest.mark.parametrize(("out_features", "in_features"), [(64, 96), (7, 40), (130, 1030)])
def test_the_kernel_equals_the_product_in_float64(rows, out_features, in_features):
    """Every row-tile size (1-4 and a remainder), output counts off the kernel's tile, inputs off its
    vector width."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    got = float_rows_op()(x, weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, rtol=1e-5, atol=1e-4)


def test_the_kernel_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="weight must be fp32 \\[out, in\\]"):
        float_rows_op()(torch.randn(2, 8), torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="x must be fp32"):
        float_rows_op()(torch.randn(2, 8, dtype=torch.float64), torch.randn(4, 8))


@pytest.mark.parametrize("rows", [1, 3, FLOAT_ROWS_MAX, FLOAT_ROWS_MAX + 1, 70])
def test_linear_with_and_without_the_kernel_equals_f_linear(rows):
    """Eagerly: the kernel (or weight first) up to FLOAT_ROWS_MAX rows, `prompt_linear` (oneDNN)
    beyond; a bias added and the leading shape kept either way."""
    x, weight, bias = torch.randn(1, rows, 48), torch.randn(24, 48), torch.randn(24)
    expected = torch.nn.functional.linear(x, weight, bias)
    for op in (float_rows_op(), None):
        torch.testing.assert_close(linear(x, weight, bias, op), expected, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_the_patched_layers_keep_torch_products(monkeypatch):
    """Where the kernel cannot be built, use_gemv binds no kernel and the products are torch's."""
    from tests.conftest import build_tiny

    monkeypatch.setattr(few_rows, "float_rows_op", lambda: None)
    model = build_tiny("llama", layers=1)
    ids = torch.tensor([[3, 4, 5]])
    expected = model(ids).logits
    patched = few_rows.use_gemv(model, rows_vary=True)
    try:
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    finally:
        few_rows.restore_linears(patched)


def test_prompt_products_keep_their_gradient():
    """Above 16 rows the product is oneDNN's, which has no gradient: with one wanted it is F.linear's."""
    x, weight = torch.randn(20, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    linear(x, weight).sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(20, 8))
    with torch.no_grad():
        torch.testing.assert_close(linear(x, weight), x @ weight.T, rtol=1e-5, atol=1e-5)
