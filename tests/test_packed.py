"""Packed integer layers (quant/packed.py): the CPU weight-only kernels against dequantize-then-matmul,
and quantized checkpoints that load and decode packed."""

import pytest
import torch

import sparsegen
from sparsegen.errors import SparsegenError
from sparsegen.kernels import Unpacked
from sparsegen.prune import prune
from sparsegen.quant import QuantScheme, make_quantizer, quantize
from sparsegen.quant.checkpoint import save_quantized
from sparsegen.quant.linear import PackedLinear
from sparsegen.quant.packed import Int4Linear, Int8Linear, dequantized, pack_linear
from tests.conftest import build_tiny, tiny_tokenizer

# The kernels take bf16 activations (2^-9 relative rounding of every input and of each output):
# an output may differ from fp32 dequantize-then-matmul by this share of the largest output.
TOLERANCE = 0.01


def _grid(bits: int, group: int, symmetric: bool, out: int = 64, inputs: int = 192, seed: int = 0):
    torch.manual_seed(seed)
    weight = torch.randn(out, inputs)
    scheme = QuantScheme(bits, group, symmetric)
    result = make_quantizer("rtn").quantize_weight(weight, scheme, None)
    groups = weight.unflatten(1, (-1, result.group_size))
    integers = scheme.integers(groups, result.scale[..., None], result.zero_point[..., None]).flatten(1)
    return integers.to(torch.int8), result.scale.half(), result.zero_point.to(torch.int8), result.weight


@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize(
    "bits,group,kernel",
    [
        (4, 32, Int4Linear),
        (4, 96, Int4Linear),
        (4, 0, Int4Linear),
        (3, 64, Int4Linear),
        (2, 32, Int4Linear),
        (8, 0, Int8Linear),
        (6, 0, Int8Linear),
    ],
)
def test_packed_linear_equals_dequantize_then_matmul(bits, group, kernel, symmetric, rows):
    integers, scale, zero_point, weight = _grid(bits, group, symmetric)
    torch.testing.assert_close(dequantized(integers, scale, zero_point).float(), weight, rtol=0, atol=0)
    bias = torch.randn(64)
    layer = pack_linear(integers, scale, zero_point, bits, bias)
    assert isinstance(layer, kernel)
    x = torch.randn(2, rows, 192)
    expected = x @ weight.T + bias
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    assert (got - expected).abs().max() <= TOLERANCE * expected.abs().max()


def test_layouts_without_a_kernel_say_why():
    integers, scale, zero_point, _ = _grid(8, 32, False)
    assert "one scale a row (--group-size 0)" in pack_linear(integers, scale, zero_point, 8).reason
    integers, scale, zero_point, _ = _grid(4, 48, False)
    assert "multiples of 32" in pack_linear(integers, scale, zero_point, 4).reason
    integers, scale, zero_point, _ = _grid(4, 32, False, out=40)
    assert "multiples of 16" in pack_linear(integers, scale, zero_point, 4).reason
    assert isinstance(pack_linear(integers.to("meta"), scale, zero_point, 4), Unpacked)  # no kernel for the device


def _packed_layers(model) -> list[PackedLinear]:
    return [m for m in model.modules() if isinstance(m, PackedLinear)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_checkpoint_loads_packed_and_decodes_as_its_dequantized_self(tmp_path, arch, bits):
    model = build_tiny(arch)
    report = quantize(model, "rtn", bits, None, False, progress=False)
    folder = save_quantized(model, tiny_tokenizer(), tmp_path / "q", report)
    packed, _ = sparsegen.load(str(folder))
    floats, _ = sparsegen.load(str(folder), packed=False)
    layers = _packed_layers(packed)
    assert len(layers) == len(report.grids) and not _packed_layers(floats)
    assert all(not isinstance(m, torch.nn.Linear) for m in packed.model.layers.modules())
    float_bytes = sum(p.numel() * 4 for n, p in floats.model.layers.named_parameters() if n.endswith("proj.weight"))
    packed_bytes = sum(b.numel() * b.element_size() for layer in layers for b in layer.buffers())
    assert packed_bytes < float_bytes * (bits + 2) / 32  # integers plus bf16 scales and offsets
    ids = torch.randint(3, 96, (1, 24))
    with torch.no_grad():
        ours, theirs = packed(ids).logits, floats(ids).logits
    assert (ours - theirs).abs().max() <= 3 * TOLERANCE * theirs.abs().max()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    assert agree >= 0.9
    prompt = [ids[0, :8].tolist()]
    steps = sparsegen.generate(packed, prompt, 6, compile="never", eos_token_id=[])
    reference = sparsegen.generate(floats, prompt, 6, compile="never", eos_token_id=[])
    assert len(steps.tokens[0]) == 6 and steps.tokens[0][0] == reference.tokens[0][0]


def test_in_memory_packing_and_the_compiled_step_agree_with_eager():
    model = build_tiny("llama")
    quantize(model, "rtn", 4, 32, False, progress=False, pack=True)
    assert len(_packed_layers(model)) == 3 * 7
    prompt = [list(range(3, 19))]
    eager = sparsegen.generate(model, prompt, 8, compile="never", eos_token_id=[])
    compiled = sparsegen.generate(model, prompt, 8, compile="always", eos_token_id=[])
    assert compiled.tokens == eager.tokens


def test_packed_models_refuse_what_needs_float_weights(capsys):
    model = build_tiny("llama")
    quantize(model, "rtn", 8, 32, False, progress=False, pack=True)  # int8 with groups: no kernel
    assert "21 quantized layer(s) run dequantized" in capsys.readouterr().err
    model = build_tiny("llama")
    quantize(model, "rtn", 4, 32, False, progress=False, pack=True)
    with pytest.raises(SparsegenError, match="cannot prune: this model's Linear layers are packed"):
        prune(model, "magnitude", 0.5, progress=False)
    with pytest.raises(SparsegenError, match="packed=False"):
        quantize(model, "rtn", 4, progress=False)


def test_a_packed_model_is_not_saved_again(tmp_path):
    model = build_tiny("llama")
    report = quantize(model, "rtn", 4, 32, False, progress=False, pack=True)
    with pytest.raises(SparsegenError, match="cannot save it as a checkpoint: this model's Linear layers are packed"):
        save_quantized(model, None, tmp_path / "q", report)


def test_a_kernel_that_disagrees_with_its_dequantized_weight_leaves_its_layers_float(monkeypatch, capsys):
    zeros = lambda self, x: torch.zeros(x.shape[0], self.out_features, dtype=x.dtype)  # noqa: E731
    monkeypatch.setattr(Int4Linear, "product", zeros)
    model = build_tiny("llama")
    reference = build_tiny("llama")
    quantize(model, "rtn", 4, 32, False, progress=False, pack=True)
    quantize(reference, "rtn", 4, 32, False, progress=False)
    assert not _packed_layers(model)
    assert "21 quantized layer(s) run dequantized" in (err := capsys.readouterr().err)
    assert "Int4Linear kernel on cpu disagrees with the dequantized weight" in err
    ids = torch.randint(3, 96, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
