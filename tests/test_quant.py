import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from sparsegen.errors import SparsegenError
from sparsegen.loading import _from_pretrained
from sparsegen.prune import InputStats, prune
from sparsegen.quant import QUANTIZERS, QuantScheme, make_quantizer, quantize
from sparsegen.quant.checkpoint import save_quantized
from sparsegen.quant.size import bits_per_weight
from tests.conftest import build_tiny
from tests.test_prune import _calibration, _linears

# The one table of quantizers the tests run over: each one's bound on its output error, as a share of
# round-to-nearest's, on correlated inputs at 3 bits. Adding a quantizer adds one row here.
ERROR_VS_RTN = {"gptq": 0.8, "rtn": 1.0}


def test_every_quantizer_has_a_row_in_the_table():
    assert set(ERROR_VS_RTN) == set(QUANTIZERS)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
def test_round_to_nearest_error_is_at_most_half_a_step_per_group(bits, symmetric):
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(bits))
    scheme = QuantScheme(bits, 32, symmetric)
    result = make_quantizer("rtn").quantize_weight(weight, scheme, None)
    assert result.scale.shape == result.zero_point.shape == (16, 3)
    step = result.scale.repeat_interleave(32, dim=1)
    fp16_rounding = result.weight.abs() * 2**-11  # the dequantized product is rounded to the scales' fp16
    assert ((result.weight - weight).abs() <= step / 2 + fp16_rounding + 1e-7).all()
    integers = scheme.integers(result.weight, step, result.zero_point.repeat_interleave(32, dim=1))
    assert integers.min() >= scheme.qmin and integers.max() <= scheme.qmax
    levels = {len(row.unique()) for row in result.weight.unflatten(1, (3, 32)).flatten(0, 1)}
    assert max(levels) <= 2**bits


def test_group_size_falls_back_to_the_largest_divisor_of_the_row():
    assert QuantScheme(group_size=128).group_for(576) == 96
    assert QuantScheme(group_size=128).group_for(1536) == 128
    assert QuantScheme(group_size=128).group_for(64) == 64


@pytest.mark.parametrize("method", sorted(QUANTIZERS))
@pytest.mark.parametrize("symmetric", [True, False])
def test_pruned_zeros_survive_quantization(method, symmetric):
    model = build_tiny("llama")
    prune(model, "wanda", 0.5, calibration=_calibration(), progress=False)
    zeros = {name: linear.weight == 0 for name, linear in _linears(model).items()}
    quantize(model, method, 4, 32, symmetric, calibration=_calibration(), progress=False)
    for name, linear in _linears(model).items():
        assert (linear.weight[zeros[name]] == 0).all(), name
        assert (linear.weight == 0).float().mean() < 0.6  # quantization did not zero much more


def test_each_quantizer_reconstructs_within_its_bound_of_rtn():
    gen = torch.Generator().manual_seed(1)
    mixing = torch.eye(128) + 0.5 * torch.randn(128, 128, generator=gen) / 128**0.5
    inputs = torch.randn(1024, 128, generator=gen) * (0.2 + 2 * torch.rand(128, generator=gen)) @ mixing
    weight = torch.randn(32, 128, generator=gen)
    stats = InputStats(128, need_hessian=True)
    stats.add(inputs)
    scheme = QuantScheme(3, 32, symmetric=False)
    errors = {
        method: (inputs @ (weight - make_quantizer(method).quantize_weight(weight, scheme, stats).weight).t())
        .pow(2)
        .sum()
        .item()
        for method in QUANTIZERS
    }
    for method, bound in ERROR_VS_RTN.items():
        assert errors[method] <= bound * errors["rtn"], method


@pytest.mark.parametrize("symmetric", [True, False])
def test_checkpoint_round_trip_gives_identical_logits(tmp_path, symmetric):
    model = build_tiny("qwen2")
    report = quantize(model, "gptq", 4, 32, symmetric, calibration=_calibration(), progress=False)
    folder = save_quantized(model, None, tmp_path / "q", report)
    ids = _calibration(1, 20, seed=5)
    with torch.no_grad():
        expected = model(ids).logits
        loaded = _from_pretrained(str(folder), {"dtype": torch.float32}, packed=False).eval()
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=0)
        if symmetric:  # transformers' own compressed-tensors loader reads the same folder; it
            # multiplies integers by scales in fp32 where sparsegen rounds the product to fp16
            theirs = AutoModelForCausalLM.from_pretrained(folder).eval()
            torch.testing.assert_close(theirs(ids).logits, expected, rtol=1e-3, atol=1e-3)
    config = json.loads((folder / "config.json").read_text())
    scheme = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert config["quantization_config"]["format"] == "pack-quantized"
    assert scheme["num_bits"] == 4 and scheme["group_size"] == 32 and scheme["symmetric"] == symmetric
    assert config["sparsegen_quantization"]["method"] == "gptq"


def test_bits_per_weight_counts_scales_zero_points_and_masks():
    model = build_tiny("llama")
    quantize(model, "rtn", 4, 32, symmetric=False, progress=False)
    dense = bits_per_weight(model, QuantScheme(4, 32, False))
    assert dense.stored == pytest.approx(4 + (16 + 4) / 32)
    prune(model, "magnitude", 0.5, progress=False)
    sparse = bits_per_weight(model, QuantScheme(4, 32, False))
    assert sparse.stored == dense.stored  # the packed layout stores zeros like any other value
    assert sparse.sparse_packed == pytest.approx(0.5 * 4 + 1 + (16 + 4) / 32, abs=0.02)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: quantize(m, "rtn", 1), "bits must be between 2 and 8"),
        (lambda m: quantize(m, "rtn", 4, -1), "group size must be a number of inputs, or 0"),
        (lambda m: quantize(m, "awq", 4), "unknown quantization method 'awq'"),
        (lambda m: quantize(m, "gptq", 4), "needs calibration"),
    ],
)
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(SparsegenError, match=message):
        call(build_tiny("llama"))


def test_a_quantizers_settings_are_recorded_in_its_checkpoint(tmp_path):
    model = build_tiny("llama")
    report = quantize(model, "gptq", 4, 32, calibration=_calibration(), progress=False, damping=0.05)
    folder = save_quantized(model, None, tmp_path / "q", report)
    assert json.loads((folder / "config.json").read_text())["sparsegen_quantization"]["settings"] == {"damping": 0.05}
