"""The Triton gather-GEMV kernels of contextual sparsity on a GPU, run here by Triton's interpreter
on CPU tensors: each equals the masked dense product, at batch 1 and 4, in fp32, bf16 and fp16;
the sparse modules' GPU paths equal the masked dense products."""

import pytest
import torch

from sparsegen.contextual import SparseMLP, sparsify
from sparsegen.contextual.input_sparse import InputSparseLinear
from sparsegen.contextual.parts import mlp_activations
from sparsegen.models import decoder_layers
from tests.conftest import build_tiny

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the same tests check the compiled kernels on a GPU
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (2e-3, 1e-2)}


@pytest.fixture
def kernels():
    """The kernels: compiled on a GPU, interpreted on CPU tensors elsewhere (tests/conftest.py)."""
    pytest.importorskip("triton")
    from sparsegen.kernels import gather

    return gather


def _close(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    rtol, atol = TOLERANCE[dtype]
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=rtol, atol=atol)


def _inputs(rows: int, dtype: torch.dtype, width: int = 96, outs: int = 200, kept: int = 40):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=generator).to(DEVICE, dtype)
    weight_t = torch.randn(width, outs, generator=generator).to(DEVICE, dtype)
    top = x.abs().topk(kept, dim=-1).indices
    mask = torch.zeros(rows, width, device=DEVICE).scatter_(1, top, 1.0)
    return x, weight_t, top, mask


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_each_rows_own_selection_equals_the_masked_product(kernels, rows, dtype):
    x, weight_t, top, mask = _inputs(rows, dtype)
    expected = (x.float() * mask) @ weight_t.float()
    _close(kernels.gathered_product(x, weight_t, top), expected, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_one_shared_selection_equals_the_masked_product(kernels, rows, dtype):
    x, weight_t, _, mask = _inputs(rows, dtype)
    union = mask.bool().any(0).nonzero().squeeze(1)
    masked = (x.float() * mask).to(dtype)
    expected = masked.float() @ weight_t.float()
    _close(kernels.gathered_product(masked, weight_t, union), expected, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_compact_values_times_their_rows(kernels, rows, dtype):
    _, weight_t, _, _ = _inputs(rows, dtype)
    index = torch.randperm(weight_t.shape[0], generator=torch.Generator().manual_seed(3))[:37].to(DEVICE)
    hidden = torch.randn(rows, 37).to(DEVICE, dtype)
    expected = hidden.float() @ weight_t.float()[index]
    _close(kernels.gathered_product(hidden, weight_t, index, compact=True), expected, dtype)


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("rows", [1, 4])
def test_kept_rows_product_equals_the_dense_product_at_those_rows(kernels, rows, dtype):
    x, _, _, _ = _inputs(rows, dtype)
    weight = torch.randn(150, x.shape[1]).to(DEVICE, dtype)
    index = torch.randperm(150, generator=torch.Generator().manual_seed(4))[:37].to(DEVICE)
    expected = (x.float() @ weight.float().t())[:, index]
    _close(kernels.product_of_rows(x, weight, index), expected, dtype)


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("shared", [False, True], ids=["per-row", "shared"])
def test_teal_projections_on_the_gpu_path_equal_the_masked_path(kernels, rows, shared):
    model = build_tiny("llama").to(DEVICE)
    attention = decoder_layers(model)[0].self_attn
    fused = InputSparseLinear([attention.q_proj, attention.k_proj, attention.v_proj], 0.5, shared)
    x = torch.randn(rows, fused.in_features, device=DEVICE)
    top = x.abs().topk(fused.keep, dim=-1).indices
    masked = torch.zeros_like(x).scatter_(1, top, x.gather(1, top))
    gathered = fused.gathered_shared(x) if shared else fused.gathered_per_row(x)
    _close(gathered, masked @ fused.weight_t, torch.float32)


@pytest.mark.parametrize("selector", ["predictor", "threshold"])
@pytest.mark.parametrize("rows", [1, 4])
def test_neuron_gathers_on_the_gpu_path_equal_the_masked_mlp(kernels, selector, rows):
    model = build_tiny("llama").to(DEVICE)
    sparsify(model, selector, 0.5, calibration=torch.randint(3, 96, (4, 24), device=DEVICE), progress=False)
    mlp = decoder_layers(model)[1].mlp
    assert isinstance(mlp, SparseMLP)
    x = torch.randn(rows, model.config.hidden_size, device=DEVICE)
    gate_act = mlp.act(mlp.gate(x)) if mlp.selector.needs_gate else None
    index = mlp.selector.keep(x, gate_act, None).any(0).nonzero().squeeze(1)
    assert 0 < index.numel() < mlp.neurons
    union = torch.zeros(mlp.neurons, device=DEVICE).index_fill_(0, index, 1.0)
    _, hidden = mlp_activations(mlp.parts, x)
    _close(mlp._gathered_on_gpu(x, index, gate_act), mlp._down(hidden * union), torch.float32)
