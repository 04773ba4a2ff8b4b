import json

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import sparsegen
import sparsegen.loading
from sparsegen.errors import SparsegenError
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.layerwise import block_linears
from sparsegen.models import decoder_layers
from sparsegen.prune import PRUNERS, InputStats, Pattern, make_pruner, prune
from sparsegen.prune.checkpoint import save_pruned
from sparsegen.prune.owl import owl_ratios
from tests.conftest import build_tiny

# The one table of pruners the tests run over: where each makes an unstructured ratio exact, "row"
# (every output row) or "matrix" (one threshold a matrix, or a SparseGPT column block: rows differ).
# Adding a pruner adds one row here.
EXACT_PER = {"magnitude": "matrix", "sparsegpt": "matrix", "wanda": "row"}
METHODS = sorted(PRUNERS)


def test_every_pruner_has_a_row_in_the_table():
    assert set(EXACT_PER) == set(PRUNERS)


def _calibration(n=4, seqlen=32, seed=0):
    return torch.randint(3, 96, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _linears(model):
    return {
        f"{i}.{name}": linear
        for i, block in enumerate(decoder_layers(model))
        for name, linear in block_linears(block).items()
    }


@pytest.mark.parametrize("method", METHODS)
def test_unstructured_sparsity_is_exact_per_layer(arch, method):
    model = build_tiny(arch)
    embeddings, head = model.get_input_embeddings().weight.clone(), model.lm_head.weight.clone()
    report = prune(model, method, 0.5, calibration=_calibration(), progress=False)
    for name, linear in _linears(model).items():
        w = linear.weight
        if EXACT_PER[method] == "matrix":  # one threshold per matrix / per 128-column block
            assert int((w == 0).sum()) == int(w.numel() * 0.5), name
        else:
            assert ((w == 0).sum(1) == int(w.shape[1] * 0.5)).all(), name
        assert report.layers[name] == pytest.approx((w == 0).float().mean().item())
    assert torch.equal(model.lm_head.weight, head) and torch.equal(model.get_input_embeddings().weight, embeddings)


@pytest.mark.parametrize("pattern", ["2:4", "4:8"])
@pytest.mark.parametrize("method", METHODS)
def test_nm_groups_are_valid(method, pattern):
    n, m = map(int, pattern.split(":"))
    model = build_tiny("qwen2")
    prune(model, method, pattern=pattern, calibration=_calibration(), progress=False)
    for name, linear in _linears(model).items():
        groups = linear.weight.reshape(linear.weight.shape[0], -1, m)
        assert ((groups == 0).sum(-1) == n).all(), name


@pytest.mark.parametrize("method", METHODS)
def test_zero_sparsity_leaves_weights_unchanged(method):
    model = build_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    prune(model, method, 0.0, calibration=_calibration(), progress=False)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_wanda_mask_equals_naive_reference():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 8, generator=gen)
    inputs = torch.randn(50, 8, generator=gen) * torch.linspace(0.1, 3, 8)
    stats = InputStats(8, need_hessian=False)
    stats.add(inputs[:20])
    stats.add(inputs[20:])
    pruned = make_pruner("wanda").prune_weight(weight, Pattern.parse(0.5), stats)
    for row in range(6):
        score = [abs(weight[row, j].item()) * sum(inputs[t, j].item() ** 2 for t in range(50)) ** 0.5 for j in range(8)]
        dropped = sorted(range(8), key=lambda j: score[j])[:4]
        expected = [0.0 if j in dropped else weight[row, j].item() for j in range(8)]
        assert pruned[row].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("pattern", [None, "2:4"])
def test_sparsegpt_reconstructs_better_than_wanda(pattern):
    gen = torch.Generator().manual_seed(1)
    mixing = torch.eye(128) + 0.5 * torch.randn(128, 128, generator=gen) / 128**0.5
    scales = 0.2 + 2 * torch.rand(128, generator=gen)
    inputs = torch.randn(1024, 128, generator=gen) * scales @ mixing  # correlated, unevenly scaled inputs
    weight = torch.randn(32, 128, generator=gen)
    stats = InputStats(128, need_hessian=True)
    stats.add(inputs)
    shape = Pattern.parse(0.5, pattern)
    errors = {}
    for method in ("wanda", "sparsegpt"):
        pruned = make_pruner(method).prune_weight(weight, shape, stats)
        assert (pruned == 0).float().mean().item() == pytest.approx(0.5)
        errors[method] = (inputs @ (weight - pruned).t()).pow(2).sum().item()
    assert errors["sparsegpt"] < 0.95 * errors["wanda"]


def test_hessian_accumulates_as_two_over_n_x_xt():
    x = torch.randn(40, 5, generator=torch.Generator().manual_seed(2))
    stats = InputStats(5, need_hessian=True)
    for part in x.split(7):
        stats.add(part)
    torch.testing.assert_close(stats.hessian, 2 / 40 * x.t().double() @ x.double(), rtol=1e-6, atol=1e-6)


def test_statistics_do_not_depend_on_how_samples_are_batched():
    samples = torch.randn(6, 10, 8, generator=torch.Generator().manual_seed(3))
    together, apart = InputStats(8, need_hessian=True), InputStats(8, need_hessian=True)
    together.add(samples)
    for order in ([4, 0], [2], [5, 1, 3]):
        apart.add(samples[order])
    assert together.samples == apart.samples == 60
    torch.testing.assert_close(apart.sq_norm, together.sq_norm, rtol=1e-14, atol=0)
    torch.testing.assert_close(apart.hessian, together.hessian, rtol=1e-14, atol=1e-15)


def test_owl_ratios_average_to_target_and_favour_outlier_blocks():
    ratios = owl_ratios([0.01, 0.05, 0.02, 0.03], 0.7)
    assert sum(ratios) / 4 == pytest.approx(0.7)
    assert ratios[1] == min(ratios) and ratios[0] == max(ratios)
    assert max(ratios) - min(ratios) == pytest.approx(0.16)
    model = build_tiny("llama")
    report = prune(model, "wanda", 0.7, calibration=_calibration(), owl=True, progress=False)
    assert report.overall == pytest.approx(0.7, abs=0.01)
    assert len(set(round(s, 3) for s in report.block_sparsity)) > 1


@pytest.mark.parametrize("compressed", [False, True])
def test_checkpoint_round_trip_gives_identical_logits(tmp_path, compressed):
    model = build_tiny("llama")
    report = prune(model, "sparsegpt", pattern="2:4", calibration=_calibration(), progress=False)
    folder = save_pruned(model, None, tmp_path / "pruned", report, compressed=compressed)
    ids = _calibration(1, 20, seed=5)
    with torch.no_grad():
        expected = model(ids).logits
        if compressed:
            loaded = sparsegen.loading._from_pretrained(str(folder), {"dtype": torch.float32})
        else:
            loaded = AutoModelForCausalLM.from_pretrained(folder)
        torch.testing.assert_close(loaded.eval()(ids).logits, expected, rtol=0, atol=0)
    config = json.loads((folder / "config.json").read_text())["sparsity_config"]
    assert config["sparsity_structure"] == "2:4" and config["method"] == "sparsegpt"
    assert config["layer_sparsity"]["0.self_attn.q_proj"] == 0.5
    assert config["format"] == ("sparse-bitmask" if compressed else "dense")


def test_compressed_checkpoint_is_smaller(tmp_path):
    model = build_tiny("llama")
    report = prune(model, "magnitude", 0.9, progress=False)
    dense = save_pruned(model, None, tmp_path / "dense", report)
    small = save_pruned(model, None, tmp_path / "small", report, compressed=True)
    size = lambda folder: sum(f.stat().st_size for f in folder.glob("*.safetensors"))  # noqa: E731
    assert size(small) < size(dense)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: prune(m, "wanda", 1.0, calibration=_calibration()), "sparsity must be in \\[0, 1\\)"),
        (lambda m: prune(m, "wanda", -0.1, calibration=_calibration()), "sparsity must be in \\[0, 1\\)"),
        (lambda m: prune(m, "wanda", pattern="4:4", calibration=_calibration()), "0 < N < M"),
        (lambda m: prune(m, "wanda", pattern="2-4", calibration=_calibration()), "N:M"),
        (lambda m: prune(m, "obs", 0.5), "unknown pruning method 'obs'"),
        (lambda m: prune(m, "wanda", 0.5), "needs calibration"),
        (lambda m: prune(nn.Sequential(nn.Linear(4, 4)), "magnitude", 0.5), "no decoder layers found"),
    ],
)
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(SparsegenError, match=message):
        call(build_tiny("llama"))


def test_windowed_ppl_matches_manual_windows():
    model = build_tiny("mistral")
    ids = torch.randint(3, 96, (100,), generator=torch.Generator().manual_seed(3))
    result = windowed_ppl(model, ids, seqlen=30, progress=False)
    assert result.windows == 3 and result.tokens == 90
    with torch.no_grad():
        nll = [
            torch.nn.functional.cross_entropy(
                model(ids[None, w * 30 : (w + 1) * 30]).logits[0, :-1], ids[w * 30 + 1 : (w + 1) * 30]
            )
            for w in range(3)
        ]
    assert result.nll == pytest.approx(torch.stack(nll).mean().item(), rel=1e-5)


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_blocks_moved_to_a_device_one_at_a_time_prune_as_in_memory(method):
    from sparsegen.layerwise_blocks import OnDevice

    here, moved = build_tiny("llama"), build_tiny("llama")
    prune(here, method, 0.5, calibration=_calibration(), progress=False)
    report = prune(moved, method, 0.5, calibration=_calibration(), progress=False, blocks=OnDevice("cpu"))
    assert report.overall == pytest.approx(0.5, abs=0.01)
    for a, b in zip(here.parameters(), moved.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_sparse_form_is_chosen_by_pattern_and_device():
    from sparsegen.prune.accelerate import CSRLinear, is_two_four, sparse_form

    model = build_tiny("llama")
    prune(model, "magnitude", pattern="2:4", progress=False)
    linear = decoder_layers(model)[0].mlp.up_proj
    assert is_two_four(linear.weight) and not is_two_four(torch.ones(4, 8))
    assert isinstance(sparse_form(linear), CSRLinear)  # semi-structured needs a GPU: CSR here, measured


def test_accelerate_swaps_only_where_faster_and_keeps_outputs():
    from sparsegen.prune.accelerate import CSRLinear, accelerate

    model = build_tiny("llama")
    prune(model, "magnitude", 0.9, progress=False)
    ids = _calibration(1, 12, seed=7)
    with torch.no_grad():
        expected = model(ids).logits
    assert accelerate(model, min_speedup=float("inf"), repeats=2) and not any(
        isinstance(m, CSRLinear) for m in model.modules()
    )
    ratios = accelerate(model, min_speedup=0.0, repeats=2)
    assert len(ratios) == 21 and all(r > 0 for r in ratios.values())
    assert sum(isinstance(m, CSRLinear) for m in model.modules()) == 21
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)


def test_bench_prune_on_a_tiny_model(tiny_folder, tiny_text, tmp_path):
    from sparsegen.bench.prune import bench_prune

    result = bench_prune(
        str(tiny_folder),
        str(tiny_text),
        n_samples=2,
        seqlen=16,
        sparsities=(0.5, 0.9),
        decode_tokens=3,
        out=tmp_path,
        progress=lambda msg: None,
        gemv_shape=(64, 32),
    )
    calibrated = [m for m in sorted(PRUNERS) if PRUNERS[m].needs_calibration]  # sparsegpt, wanda
    assert [row["method"] for row in result["timing"]] == sorted(PRUNERS) + calibrated
    assert len(calibrated) == 2 and "magnitude" not in calibrated
    assert all(row["seconds"] > 0 for row in result["timing"])
    assert [row["sparsity"] for row in result["speed"]] == [0.5, 0.9]
    assert all(row["dense_tok_s"] > 0 and row["sparse_tok_s"] > 0 for row in result["speed"])
    assert all(row["csr32_us"] > 0 for row in result["gemv"])
    assert "2:4 semi-structured: not run" in (tmp_path / "bench_prune.md").read_text()


def test_sparsegpt_row_scope_keeps_every_row_ratio():
    model = build_tiny("llama")
    prune(model, "sparsegpt", 0.5, calibration=_calibration(), progress=False, mask_scope="row")
    for name, linear in _linears(model).items():
        assert ((linear.weight == 0).sum(1) == linear.weight.shape[1] // 2).all(), name


def test_sparsegpt_block_scope_keeps_the_layer_ratio_but_not_each_row():
    gen = torch.Generator().manual_seed(4)
    inputs = torch.randn(256, 64, generator=gen) * (0.2 + 2 * torch.rand(64, generator=gen))
    weight = torch.randn(16, 64, generator=gen) * (0.1 + torch.rand(16, 1, generator=gen))
    stats = InputStats(64, need_hessian=True)
    stats.add(inputs)
    pruned = make_pruner("sparsegpt", mask_scope="block").prune_weight(weight, Pattern.parse(0.5), stats)
    assert int((pruned == 0).sum()) == 16 * 32
    assert len(set((pruned == 0).sum(1).tolist())) > 1
    with pytest.raises(SparsegenError, match="mask_scope"):
        make_pruner("sparsegpt", mask_scope="column")


def test_a_pruners_settings_are_recorded_in_its_checkpoint(tmp_path):
    model = build_tiny("qwen2")
    report = prune(model, "sparsegpt", 0.5, calibration=_calibration(), progress=False, mask_scope="row", damping=0.02)
    assert report.settings == {"block_size": 128, "damping": 0.02, "mask_scope": "row"}
    folder = save_pruned(model, None, tmp_path / "pruned", report)
    config = json.loads((folder / "config.json").read_text())["sparsity_config"]
    assert config["settings"] == report.settings
    with pytest.raises(SparsegenError, match="pruner 'sparsegpt'.*unexpected keyword argument 'blocksize'"):
        prune(build_tiny("qwen2"), "sparsegpt", 0.5, calibration=_calibration(), blocksize=64)


def test_linears_reading_one_tensor_share_their_statistics():
    from sparsegen.layerwise import capture_inputs, collect_stats

    model = build_tiny("llama")
    inputs, kwargs, dtype = capture_inputs(model, _calibration(), 2, None)
    _, stats = collect_stats(decoder_layers(model)[0], inputs, kwargs[0], dtype, need_hessian=True)
    attention, mlp = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
    assert len({id(stats[f"self_attn.{n}"]) for n in attention}) == 1 and len({id(stats[f"mlp.{n}"]) for n in mlp}) == 1
    assert len({id(s) for s in stats.values()}) == 4  # qkv, o, gate/up, down
    assert stats["self_attn.q_proj"].samples == 4 * 32 and stats["self_attn.o_proj"].samples == 4 * 32
