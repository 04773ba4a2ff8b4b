"""A layer's RMSNorm and SiLU-times-up in one pass (`kernels/layer_ops.cpp`, `fused_layers`)
against float64 and against the model's own forward."""

import pytest
import torch

from sparsegen.decode.reading import read_packed
from sparsegen.fused_layers import fuse_layers, fused_layers, layer_ops_built, restore_layers
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from tests.conftest import build_tiny

pytestmark = pytest.mark.skipif(not layer_ops_built(), reason="the fused layer ops cannot be built here")
BF16_STEP = 2.0**-8  # a bf16 number's spacing relative to its size


def rounded(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return values.to(dtype).double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 7), (3, 576), (37, 200), (2, 5, 1536)])
def test_rms_norm_equals_the_norm_in_float64(dtype, shape):
    """Widths off the 8- and 16-lane loops; rounded where the model rounds (after the norm, after the weight)."""
    generator = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(shape, generator=generator) * 3).to(dtype)
    weight = torch.randn(shape[-1], generator=generator).to(dtype)
    got = torch.ops.sparsegen.rms_norm(x, weight, 1e-5)
    normed = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    expected = rounded(weight.double() * rounded(normed, dtype), dtype)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = BF16_STEP if dtype == torch.bfloat16 else 1e-6  # a rounding that fp32's sum order may flip
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 5), (4, 1536), (9, 203)])
def test_silu_mul_equals_silu_times_up_in_float64(dtype, shape):
    generator = torch.Generator().manual_seed(sum(shape))
    gate = (torch.randn(shape, generator=generator) * 4).to(dtype)
    up = torch.randn(shape, generator=generator).to(dtype)
    got = torch.ops.sparsegen.silu_mul(gate, up)
    silu = rounded(gate.double() / (1 + torch.exp(-gate.double())), dtype)
    expected = rounded(silu * up.double(), dtype)
    tolerance = BF16_STEP if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=1e-30)


def test_silu_mul_keeps_far_gates_finite():
    """Gates past exp's range: SiLU is about the gate above, about zero below."""
    gate = torch.tensor([-200.0, -90.0, -30.0, 0.0, 30.0, 90.0, 200.0] * 3)
    got = torch.ops.sparsegen.silu_mul(gate, torch.ones_like(gate))
    torch.testing.assert_close(got.double(), torch.nn.functional.silu(gate.double()), rtol=1e-6, atol=1e-30)


def test_the_ops_refuse_mixed_dtypes():
    with pytest.raises(RuntimeError, match="weight \\[d\\] of x's dtype"):
        torch.ops.sparsegen.rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="of one shape"):
        torch.ops.sparsegen.silu_mul(torch.ones(2, 8), torch.ones(2, 9))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_model_gives_its_own_logits(arch, dtype):
    """Every norm and MLP of the tiny model is given the fused forward, the logits are the eager
    model's own, and the model is left as it was."""
    model = build_tiny(arch, attn="eager").to(dtype)
    ids = torch.randint(0, 96, (2, 19), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        expected = model(ids).logits.double()
        patched = fuse_layers(model)
        try:
            got = model(ids).logits.double()
        finally:
            restore_layers(patched)
    layers = len(model.model.layers)
    assert len(patched) == 3 * layers + 1  # two norms and the MLP a layer, and the final norm
    assert not any("forward" in module.__dict__ for module in model.modules())
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_gemma_keeps_its_own_norms_and_gelu_mlp():
    """Gemma's norm scales by one plus its weight and its MLP is GELU: not the forwards fused here."""
    assert fuse_layers(build_tiny("gemma3")) == []


def test_with_gradients_the_model_s_own_forward_runs():
    """The ops have no gradient: a training forward takes the model's code and can be backpropagated."""
    model = build_tiny("llama")
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    with fused_layers(model):
        model(ids).logits.sum().backward()
    assert model.model.layers[0].mlp.gate_proj.weight.grad is not None


def test_a_packed_read_through_the_fused_layers_keeps_each_prompt_s_logits():
    """The server's packed read (which fuses the layers) against each prompt read alone by the bare model."""
    model = build_tiny("qwen2", attn="eager").to(torch.bfloat16)
    prompts = [[5, 9, 11, 3, 7], [8, 1, 4, 2, 6, 10, 12]]
    caches = [make_cache(model, "full") for _ in prompts]
    with torch.inference_mode(), policy_attention(model):
        got = read_packed(model, prompts, caches)
    with torch.inference_mode():
        alone = [model(torch.tensor([prompt])).logits[0, -1].float() for prompt in prompts]
    torch.testing.assert_close(got, torch.stack(alone), rtol=0.02, atol=0.02)
