"""Integer-dot int4 layers (quant/int_dot.py): the C++ op against the same arithmetic written in
torch, the layouts it takes, and checkpoints loaded with `activation_bits=8`."""

import pytest
import torch

import sparsegen
from sparsegen.errors import SparsegenError
from sparsegen.quant import quantize
from sparsegen.quant.checkpoint import save_quantized
from sparsegen.quant.int_dot import BLOCK, MAX_ROWS, Int8DotLinear, IntDotLinear, int4_linear, repack
from sparsegen.quant.packed import Int4Linear, Int8Linear, pack_linear
from tests.conftest import build_tiny, tiny_tokenizer
from tests.test_packed import _grid


def reference(x: torch.Tensor, nibbles: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The op's arithmetic in torch: inputs rounded to int8 per block of 32 (step = max|x| / 127),
    the weight u * scale - min with u read from the nibbles, products summed in float64."""
    rows, inputs = x.shape
    blocks = x.view(rows, -1, BLOCK)
    largest = blocks.abs().amax(-1, keepdim=True)
    codes = torch.where(largest > 0, (blocks * (127 / largest)).round(), 0.0)
    rounded = (codes * largest / 127).view(rows, inputs).double()
    pairs = nibbles.view(nibbles.shape[0], -1, BLOCK // 2)
    u = torch.cat([pairs & 15, pairs >> 4], -1).double()  # [out, blocks, 32] in input order
    weight = u * scales.double()[..., None] - mins.double()[..., None]
    return rounded @ weight.flatten(1).T


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
@pytest.mark.parametrize("bits,group,symmetric", [(4, 32, False), (4, 96, False), (4, 64, True), (3, 32, False)])
def test_the_op_equals_its_arithmetic_in_torch(rows, bits, group, symmetric):
    integers, scale, zero_point, _ = _grid(bits, group, symmetric)
    nibbles, scales, mins = repack(integers, scale, zero_point)
    x = torch.randn(rows, integers.shape[1], generator=torch.Generator().manual_seed(rows))
    x[0, :BLOCK] = 0.0  # a block of zeros has no step
    got = int4_linear(x, nibbles, scales, mins)
    expected = reference(x, nibbles, scales, mins)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16])
def test_the_int8_op_equals_its_arithmetic_in_torch(rows):
    """Both operands int8 per block of 32: the sum of q * a per block, times both steps."""
    weight = torch.randn(40, 96, generator=torch.Generator().manual_seed(7)) * 0.1
    weight[3, :BLOCK] = 0.0  # a block of zero weights
    layer = Int8DotLinear.rounded(weight)
    assert layer.codes.dtype == torch.int8 and layer.codes.abs().max() <= 127
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows))
    x[0, BLOCK:] = 0.0  # blocks of zeros have no step
    largest = x.view(rows, -1, BLOCK).abs().amax(-1, keepdim=True)
    codes = torch.where(largest > 0, (x.view(rows, -1, BLOCK) * (127 / largest)).round(), 0.0)
    rounded = (codes * largest / 127).view(rows, -1).double()
    expected = rounded @ layer.weight().double().T
    got = torch.ops.sparsegen.int8_linear(x, layer.codes, layer.scales)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4 * expected.abs().max().item())
    step = layer.scales.repeat_interleave(BLOCK, 1)
    assert ((layer.weight() - weight).abs() <= step / 2 + 1e-7).all()  # rounded to the nearest step
    prompt = torch.randn(MAX_ROWS + 1, 96)
    torch.testing.assert_close(layer(prompt), prompt @ layer.weight().T)


def test_the_repacked_weight_is_the_grid_and_prompts_multiply_it_in_float():
    integers, scale, zero_point, _ = _grid(4, 96, False)
    layer = IntDotLinear(*repack(integers, scale, zero_point))
    weight = layer.weight()
    prompt = torch.randn(MAX_ROWS + 1, integers.shape[1])
    torch.testing.assert_close(layer(prompt), prompt @ weight.T)
    group = integers.shape[1] // scale.shape[1]
    grid = (integers.float().unflatten(1, (-1, group)) - zero_point.float()[..., None]) * scale.float()[..., None]
    torch.testing.assert_close(weight, grid.flatten(1), rtol=0, atol=1e-5)


def test_layers_the_op_does_not_take_keep_weight_only_products_and_say_why():
    verdicts = {}
    int8 = pack_linear(*_grid(8, 0, False)[:3], 8, verdicts=verdicts, activation_bits=8)
    assert isinstance(int8, Int8Linear) and "int8 weights" in verdicts["integer-dot"].reason
    int4 = pack_linear(*_grid(4, 32, False)[:3], 4, verdicts=verdicts, activation_bits=8)
    assert isinstance(int4, IntDotLinear) and verdicts[IntDotLinear] is None
    assert isinstance(pack_linear(*_grid(4, 32, False)[:3], 4), Int4Linear)  # weight-only unless asked
    with pytest.raises(SparsegenError, match="activation_bits must be 8"):
        sparsegen.load("unused", activation_bits=4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_checkpoint_loaded_with_integer_dot_products_decodes_like_its_weight_only_self(tmp_path, arch):
    model = build_tiny(arch)
    report = quantize(model, "rtn", 4, 32, False, progress=False)
    folder = save_quantized(model, tiny_tokenizer(), tmp_path / "q", report)
    weight_only, _ = sparsegen.load(str(folder), device="cpu")  # integer-dot products run on a CPU
    integer_dot, _ = sparsegen.load(str(folder), device="cpu", activation_bits=8)
    layers = [m for m in integer_dot.modules() if isinstance(m, IntDotLinear)]
    assert len(layers) == len(report.grids)
    head = integer_dot.get_output_embeddings()  # the head in int8 too, the input embedding untouched
    assert isinstance(head, Int8DotLinear) and not isinstance(weight_only.get_output_embeddings(), Int8DotLinear)
    embedding = integer_dot.get_input_embeddings().weight
    assert torch.equal(embedding, weight_only.get_input_embeddings().weight)
    assert (head.weight() - weight_only.get_output_embeddings().weight).abs().max() <= head.scales.max()
    ids = torch.randint(3, 96, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = integer_dot(ids).logits, weight_only(ids).logits
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    prompt = [ids[0, :8].tolist()]
    eager = sparsegen.generate(integer_dot, prompt, 8, compile="never", eos_token_id=[])
    compiled = sparsegen.generate(integer_dot, prompt, 8, compile="always", eos_token_id=[])
    assert compiled.mode == "compiled" and compiled.tokens == eager.tokens


def test_build_all_builds_every_kernel_source_of_the_package(monkeypatch):
    """What `make install` runs: every C++ source the package loads, each once."""
    from sparsegen import kernels
    from sparsegen.kernels import build

    built = []
    monkeypatch.setattr(build, "build", lambda source, what: built.append(source.resolve()))
    loaders = (
        kernels.load_kv_int,
        kernels.load_int_dot,
        kernels.load_gguf_dot,
        kernels.load_float_rows,
        kernels.load_sparse_mlp,
        kernels.load_layer_ops,
    )
    for load in loaders:
        load()  # the sources the package loads
    loaded, built = sorted(built), []
    build.build_all()
    assert sorted(built) == loaded and len(set(loaded)) == len(loaders)
