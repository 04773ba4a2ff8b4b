"""On a CUDA GPU: the fast path equals transformers' generate() for every policy (eager and as a
replayed CUDA graph), contextual sparsity runs its Triton kernels, and pruned and quantized
checkpoints made on the GPU load and generate there."""

import pytest
import torch

import sparsegen
from sparsegen.contextual import sparsify
from sparsegen.decode import generate
from sparsegen.kv import make_cache
from sparsegen.kv.spec import KVSpec
from sparsegen.prune import prune
from sparsegen.prune.checkpoint import save_pruned
from sparsegen.quant import quantize
from sparsegen.quant.checkpoint import save_quantized
from sparsegen.quant.linear import PackedLinear
from sparsegen.quant.packed import Int4Linear, Int8Linear, pack_linear
from tests.conftest import build_tiny, tiny_tokenizer
from tests.kv_reference import TABLE, generate_drop_in

CUDA = torch.device("cuda")


def _prompt(length: int = 21, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed)).to(CUDA)


def _reference(model, ids, policy, budget, new):
    return generate_drop_in(model, ids, make_cache(model, KVSpec.of(policy, **budget)), new)


@pytest.mark.parametrize("compile", ["never", "always"])
@pytest.mark.parametrize("policy", list(TABLE))
def test_fast_path_equals_generate_on_cuda(policy, compile):
    model = build_tiny("llama").to(CUDA)  # fp32: the same arithmetic in both engines, token for token
    ids = _prompt()
    budget = TABLE[policy].small
    out = generate(model, ids, 24, KVSpec.of(policy, **budget), compile=compile)
    assert out.tokens[0] == _reference(model, ids, policy, budget, 24)
    assert out.mode == ("compiled" if compile == "always" else "eager")


def test_bf16_decoding_keeps_its_cache_in_bf16_and_agrees_with_generate():
    model = build_tiny("llama").to(CUDA, torch.bfloat16)
    ids = _prompt()
    out = generate(model, ids, 16, KVSpec.of("h2o", heavy=6, recent=6), compile="never")
    assert out.tokens[0][:4] == _reference(model, ids, "h2o", {"heavy": 6, "recent": 6}, 16)[:4]


@pytest.mark.parametrize("selector", ["teal", "threshold", "predictor"])
def test_contextual_sparsity_with_everything_kept_generates_the_dense_tokens_on_cuda(selector):
    model = build_tiny("llama").to(CUDA)
    ids = _prompt(10)
    dense = model.generate(ids, max_new_tokens=12, do_sample=False)
    calibration = torch.randint(3, 96, (4, 24), device=CUDA)
    sparsify(model, selector, 0.0, calibration=calibration, progress=False)
    assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), dense)


@pytest.mark.parametrize("selector", ["teal", "teal-shared", "threshold"])
def test_contextual_sparsity_decodes_through_the_triton_kernels_on_cuda(selector):
    model = build_tiny("llama").to(CUDA)
    settings = {"batch_selection": "shared"} if selector == "teal-shared" else {}
    calibration = torch.randint(3, 96, (4, 24), device=CUDA)
    sparsify(model, selector.split("-")[0], 0.5, calibration=calibration, progress=False, **settings)
    batch = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14], [20, 21], [30, 31, 32]]
    rows = generate(model, batch, 8, compile="never", eos_token_id=[]).tokens
    singles = [generate(model, [prompt], 8, compile="never", eos_token_id=[]).tokens[0] for prompt in batch]
    assert len(rows) == 4 and all(len(row) == 8 for row in rows)
    if selector.startswith("teal"):  # each row keeps its own inputs: a batch row is its single run
        assert rows == singles


def test_pruned_and_quantized_checkpoints_made_on_cuda_load_and_generate(tmp_path):
    calibration = torch.randint(3, 96, (4, 32), device=CUDA)
    ids = _prompt(8)
    model = build_tiny("llama").to(CUDA)
    report = prune(model, "sparsegpt", pattern="2:4", calibration=calibration, progress=False)
    pruned = save_pruned(model, tiny_tokenizer(), tmp_path / "pruned", report, compressed=True)
    model = build_tiny("llama").to(CUDA)
    report = quantize(model, "gptq", 4, 32, True, calibration=calibration, progress=False)
    quantized = save_quantized(model, tiny_tokenizer(), tmp_path / "quantized", report)
    for folder in (pruned, quantized):
        loaded, _ = sparsegen.load(str(folder), device="cuda", dtype=torch.float32)
        assert next(loaded.parameters()).is_cuda
        tokens = generate(loaded, ids, 8, compile="never", eos_token_id=[]).tokens[0]
        assert len(tokens) == 8


def test_a_two_four_checkpoint_runs_semi_structured_where_faster_on_cuda(tmp_path, capfd):
    from sparsegen.prune.accelerate import SemiStructuredLinear

    model = build_tiny("llama")
    for layer in model.model.layers:  # shapes semi-structured kernels take (multiples of 64 and 128)
        for name in ("gate_proj", "up_proj"):
            setattr(layer.mlp, name, torch.nn.Linear(64, 128, bias=False))
        layer.mlp.down_proj = torch.nn.Linear(128, 64, bias=False)
    model.config.intermediate_size = 128
    report = prune(model, "magnitude", pattern="2:4", progress=False)
    folder = save_pruned(model, tiny_tokenizer(), tmp_path / "pruned", report)
    dense, _ = sparsegen.load(str(folder), device="cpu", dtype=torch.bfloat16)
    loaded, _ = sparsegen.load(str(folder), device="cuda")  # bf16
    said = capfd.readouterr().err
    assert "2:4 checkpoint:" in said and "run semi-structured" in said
    ids = _prompt(8)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(ids).logits.cpu().float(), dense(ids.cpu()).logits.float(), rtol=0.05, atol=0.05
        )
    semi = sum(isinstance(m, SemiStructuredLinear) for m in loaded.modules())
    print(f"{semi} layers semi-structured")  # the measured choice, for the log


def test_a_model_in_ram_is_pruned_on_the_gpu_one_block_at_a_time():
    from sparsegen.layerwise_blocks import OnDevice

    calibration = torch.randint(3, 96, (4, 32))
    here, moved = build_tiny("llama"), build_tiny("llama")
    prune(here, "wanda", 0.5, calibration=calibration, calibration_dtype=None, progress=False)
    prune(moved, "wanda", 0.5, calibration=calibration, calibration_dtype=None, progress=False,
          blocks=OnDevice("cuda"))  # fmt: skip
    assert all(not p.is_cuda for p in moved.parameters())  # each block went back to RAM
    pairs = zip(here.parameters(), moved.parameters(), strict=True)
    same = [((a == 0) == (b == 0)).float().mean().item() for a, b in pairs]
    assert min(same) > 0.99  # the same masks, up to ties the GPU's arithmetic breaks otherwise


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits,group,kernel", [(4, 32, Int4Linear), (4, 96, Int4Linear), (8, 0, Int8Linear)])
def test_packed_layers_on_cuda_equal_dequantize_then_matmul(bits, group, kernel, symmetric):
    from tests.test_packed import TOLERANCE, _grid

    integers, scale, zero_point, weight = _grid(bits, group, symmetric)
    layer = pack_linear(integers.to(CUDA), scale.to(CUDA), zero_point.to(CUDA), bits)
    assert isinstance(layer, kernel) and all(buffer.is_cuda for buffer in layer.buffers())
    for rows in (1, 4):
        x = torch.randn(rows, weight.shape[1], device=CUDA)
        expected = x @ weight.to(CUDA).T
        assert (layer(x) - expected).abs().max() <= TOLERANCE * expected.abs().max()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_checkpoint_loads_packed_on_cuda_and_decodes_as_its_dequantized_self(tmp_path, bits, capfd):
    model = build_tiny("llama")
    report = quantize(model, "rtn", bits, None, False, progress=False)
    folder = save_quantized(model, tiny_tokenizer(), tmp_path / "q", report)
    packed, _ = sparsegen.load(str(folder), device="cuda")
    floats, _ = sparsegen.load(str(folder), device="cuda", packed=False)
    layers = [m for m in packed.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == len(report.grids) and all(next(m.buffers()).is_cuda for m in layers)
    assert "run dequantized" not in capfd.readouterr().err
    prompt = [list(range(3, 19))]
    eager = generate(packed, prompt, 6, compile="never", eos_token_id=[])
    compiled = generate(packed, prompt, 6, compile="always", eos_token_id=[])
    reference = generate(floats, prompt, 6, compile="never", eos_token_id=[])
    assert compiled.tokens == eager.tokens and eager.tokens[0][0] == reference.tokens[0][0]
