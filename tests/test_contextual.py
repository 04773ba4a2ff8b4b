"""Contextual sparsity: sparse MLPs equal the dense model with everything kept, the gathered path
equals the masked dense MLP, calibration hits its target, bad inputs are clear errors."""

import json

import pytest
import torch
from torch import nn

from sparsegen.contextual import SELECTORS, SparseMLP, densify, load_selectors, save_selectors, sparsify
from sparsegen.contextual.apply import (
    collect_stats,
    installed_selectors,
    read_bytes,
)
from sparsegen.contextual.input_sparse import InputSparseLinear
from sparsegen.contextual.parts import mlp_parts
from sparsegen.errors import SparsegenError
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.models import decoder_layers
from tests.conftest import build_tiny

# The one table of neuron selectors the tests run over: how each one's MLP runs a decode step.
# "gathered": a SparseMLP reading only the kept neurons' rows; "masked": a SparseMLP computing
# every neuron (the choice needs h); "input-sparse": TEAL's projections. Adding a selector adds one
# row here.
RUNS = {
    "oracle": "masked",
    "predictor": "gathered",
    "static": "gathered",
    "teal": "input-sparse",
    "threshold": "gathered",
    "wina": "input-sparse",
}
GATHERED = [name for name, runs in RUNS.items() if runs == "gathered"]


def test_every_selector_has_a_row_in_the_table():
    assert set(RUNS) == set(SELECTORS)


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_each_selector_runs_as_its_row_says(selector):
    model = build_tiny("llama")
    sparsify(model, selector, 0.5, calibration=_ids(), progress=False)
    mlp = decoder_layers(model)[0].mlp
    runs = "input-sparse" if not isinstance(mlp, SparseMLP) else "masked" if mlp.selector.needs_hidden else "gathered"
    assert runs == RUNS[selector]


def _ids(n=4, seqlen=24, seed=0):
    return torch.randint(3, 96, (n, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_everything_kept_generates_the_dense_tokens(arch, selector):
    model = build_tiny(arch)
    prompt = _ids(1, 10, seed=1)
    with torch.no_grad():
        dense_logits = model(prompt).logits
    dense = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    sparsify(model, selector, 0.0, calibration=_ids(), progress=False)
    assert all(s is not None for s in installed_selectors(model))
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0), dense)
    with torch.no_grad():
        torch.testing.assert_close(model(prompt).logits, dense_logits, rtol=1e-5, atol=1e-5)
    densify(model)
    assert installed_selectors(model) == [None] * len(decoder_layers(model))
    assert not any(isinstance(m, SparseMLP | InputSparseLinear) for m in model.modules())


@pytest.mark.parametrize("selector", GATHERED)
@pytest.mark.parametrize("rows", [1, 3])
def test_the_gathered_mlp_equals_the_dense_mlp_with_unkept_neurons_masked(arch, selector, rows):
    model = build_tiny(arch)
    sparsify(model, selector, 0.5, calibration=_ids(), progress=False)
    sparse = decoder_layers(model)[1].mlp
    parts = mlp_parts(sparse.original)
    x = torch.randn(rows, 1, model.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.no_grad():
        flat = x[:, 0]
        gate_act = parts.act(parts.gate(flat))
        hidden = gate_act * parts.up(flat)
        keep = sparse.selector.keep(flat, gate_act, hidden).any(0)  # rows share the union of their sets
        assert 0.2 < keep.float().mean() < (0.8 if rows == 1 else 0.98)
        expected = parts.down(hidden * keep)
        torch.testing.assert_close(sparse(x)[:, 0], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("selector", ["teal", "wina"])
@pytest.mark.parametrize("rows", [1, 3])
def test_input_sparsity_reads_only_the_kept_inputs_rows_and_equals_the_masked_dense_layer(arch, selector, rows):
    model = build_tiny(arch)
    sparsify(model, selector, 0.4, progress=False)
    layer = decoder_layers(model)[1]
    attention, mlp = layer.self_attn.original, layer.mlp.original
    groups = {  # each InputSparseLinear and the dense Linears it stands for, side by side
        layer.self_attn.qkv: [attention.q_proj, attention.k_proj, attention.v_proj],
        layer.self_attn.o: [attention.o_proj],
        layer.mlp.gate_up: [mlp.gate_proj, mlp.up_proj],
        layer.mlp.down: [mlp.down_proj],
    }
    for sparse, linears in groups.items():
        x = torch.randn(rows, 1, sparse.in_features, generator=torch.Generator().manual_seed(rows))
        flat = x[:, 0]
        # TEAL keeps the largest |x|; WINA the largest |x| times the norm of the weights x multiplies
        norms = torch.cat([linear.weight for linear in linears]).detach().double().pow(2).sum(0).sqrt()
        scores = flat.abs().double() * (norms if selector == "wina" else 1.0)
        top = scores.topk(sparse.keep, dim=-1).indices
        masked = torch.zeros_like(flat).scatter_(1, top, flat.gather(1, top))
        assert 0 < (masked == 0).float().mean() < 1
        with torch.no_grad():
            expected = torch.cat([linear(masked) for linear in linears], -1)
            torch.testing.assert_close(sparse(x)[:, 0], expected, rtol=1e-5, atol=1e-5)
    read, total = read_bytes(model, _ids(1, 8))
    assert read / total == pytest.approx(0.6, abs=0.03)  # the split keeps the layers' skipped share at 40%


def test_wina_and_teal_choose_differently_when_the_weights_columns_differ():
    model = build_tiny("llama")
    down = decoder_layers(model)[1].mlp.down_proj
    with torch.no_grad():
        down.weight[:, ::2] *= 20  # the even inputs multiply far larger weights
    x = torch.rand(1, 1, down.in_features, generator=torch.Generator().manual_seed(3)) + 1.0
    x[..., 1::2] *= 2  # ... while the odd inputs are larger
    chosen = {}
    for selector in ("teal", "wina"):
        sparsify(model, selector, 0.5, progress=False)
        sparse = decoder_layers(model)[1].mlp.down
        chosen[selector] = set(sparse.kept(x[:, 0])[0].tolist())
        densify(model)
    odd = set(range(1, down.in_features, 2))
    assert len(chosen["teal"] & odd) > len(chosen["teal"]) * 0.9  # TEAL keeps the large inputs
    assert len(chosen["wina"] & odd) < len(chosen["wina"]) * 0.1  # WINA the ones on large weights


def test_threshold_calibration_hits_the_target_sparsity():
    model = build_tiny("llama")
    calibration = _ids(6, 32)
    selectors = sparsify(model, "threshold", 0.6, calibration=calibration, progress=False)
    densify(model)
    stats = collect_stats(model, calibration)
    for selector, layer in zip(selectors, stats, strict=True):
        kept = selector.keep(None, layer.gate_act, layer.hidden).float().mean().item()
        assert kept == pytest.approx(0.4, abs=0.01)


def test_a_plain_relu_mlp_is_supported():
    class ReluMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.up_proj, self.down_proj, self.act_fn = nn.Linear(8, 32), nn.Linear(32, 8), nn.ReLU()

        def forward(self, x):
            return self.down_proj(self.act_fn(self.up_proj(x)))

    torch.manual_seed(0)
    mlp = ReluMLP()
    selector = SELECTORS["threshold"](0.0)
    selector.threshold = torch.tensor(0.0)  # ReLU zeros are exact: keeping the positive ones is lossless
    sparse = SparseMLP(mlp_parts(mlp), selector)
    x = torch.randn(1, 1, 8)
    with torch.no_grad():
        torch.testing.assert_close(sparse(x), mlp(x), rtol=1e-5, atol=1e-6)
        assert selector.keep(None, mlp.act_fn(mlp.up_proj(x[0])), None).float().mean() < 0.8


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_selectors_round_trip_and_refuse_another_model(tmp_path, selector):
    model = build_tiny("qwen2")
    selectors = sparsify(model, selector, 0.5, calibration=_ids(), dense_layers=1, progress=False)
    save_selectors(model, selectors, tmp_path, selector, 0.5)
    with torch.no_grad():
        expected = model(_ids(1, 12, seed=4)).logits
    densify(model)
    with torch.no_grad():
        assert not torch.allclose(model(_ids(1, 12, seed=4)).logits, expected, atol=1e-4)
    fresh = build_tiny("qwen2")
    loaded = load_selectors(fresh, tmp_path)
    assert loaded[0] is None and installed_selectors(fresh)[0] is None and loaded[1] is not None
    assert not any(isinstance(m, SparseMLP | InputSparseLinear) for m in decoder_layers(fresh)[0].modules())
    with torch.no_grad():
        torch.testing.assert_close(fresh(_ids(1, 12, seed=4)).logits, expected, rtol=0, atol=0)
    with pytest.raises(SparsegenError, match="made for another model"):
        load_selectors(build_tiny("gemma3"), tmp_path)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: sparsify(m, "threshold", 1.0, calibration=_ids()), "sparsity must be in \\[0, 1\\)"),
        (lambda m: sparsify(m, "threshold", -0.2, calibration=_ids()), "sparsity must be in \\[0, 1\\)"),
        (lambda m: sparsify(m, "dejavu2", 0.5), "unknown neuron selector 'dejavu2'"),
    ],
)
def test_bad_inputs_are_clear_errors(call, message):
    with pytest.raises(SparsegenError, match=message):
        call(build_tiny("llama"))


def test_a_model_without_a_known_mlp_is_a_clear_error():
    model = build_tiny("llama")
    for layer in decoder_layers(model):
        layer.mlp = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(SparsegenError, match="neither a gated MLP"):
        sparsify(model, "threshold", 0.5, calibration=_ids())


def test_sparse_mlps_compose_with_a_kv_policy_and_a_pruned_model():
    from sparsegen.kv import make_cache
    from sparsegen.prune import prune

    model = build_tiny("mistral")
    prune(model, "wanda", 0.5, calibration=_ids(), progress=False)
    prompt = _ids(1, 20, seed=2)
    with policy_attention(model):
        expected = model.generate(
            prompt, cache=make_cache(model, KVSpec.of("streaming", budget=12)), max_new_tokens=10, do_sample=False
        )
    sparsify(model, "threshold", 0.0, calibration=_ids(), progress=False)
    with policy_attention(model):
        got = model.generate(
            prompt, cache=make_cache(model, KVSpec.of("streaming", budget=12)), max_new_tokens=10, do_sample=False
        )
    assert torch.equal(got, expected)
    sparsify(model, "threshold", 0.5, calibration=_ids(), progress=False)
    cache = make_cache(model, KVSpec.of("streaming", budget=12))
    with policy_attention(model):
        model.generate(prompt, cache=cache, max_new_tokens=10, do_sample=False)
    assert cache.physical_length() <= 13


@pytest.mark.parametrize("selector", sorted(SELECTORS))
def test_sparse_models_on_the_fast_path_equal_transformers_generate(arch, selector):
    model = build_tiny(arch)
    sparsify(model, selector, 0.4, calibration=_ids(), progress=False)
    assert_fast_path_equals_transformers(model)


def assert_fast_path_equals_transformers(model) -> None:
    """sparsegen's H2O decode of a sparsified `model` gives transformers' greedy tokens."""
    from sparsegen.decode import generate
    from sparsegen.kv import make_cache

    prompt = _ids(1, 20, seed=3)
    with policy_attention(model):
        expected = model.generate(
            prompt, cache=make_cache(model, KVSpec.of("h2o", heavy=4, recent=6)), max_new_tokens=8, do_sample=False
        )
    got = generate(model, prompt, 8, KVSpec.of("h2o", heavy=4, recent=6), compile="never", eos_token_id=[])
    assert got.tokens[0] == expected[0, 20:].tolist()


def test_quality_curve_and_speed_bench_on_a_tiny_model(tiny_folder, tiny_text, tmp_path):
    from sparsegen.bench.contextual import bench_contextual
    from sparsegen.contextual.quality import quality_curve

    model = build_tiny("llama")
    rows = quality_curve(model, _ids(1, 200)[0], _ids(), ["oracle", "threshold"], [0.0, 0.5], seqlen=50, windows=3)
    assert rows[0]["selector"] == "dense" and rows[0]["kl"] == pytest.approx(0, abs=1e-4)  # fp16 reference
    by_key = {(r["selector"], r["sparsity"]): r for r in rows}
    assert by_key[("oracle", 0.0)]["top1"] == 1.0 and by_key[("threshold", 0.0)]["kl"] < 1e-4
    assert by_key[("oracle", 0.5)]["kept"] == pytest.approx(0.5, abs=0.02)
    assert by_key[("oracle", 0.5)]["kl"] > 0 and by_key[("oracle", 0.5)]["kl"] < by_key[("threshold", 0.5)]["kl"]
    bench = bench_contextual(
        str(tiny_folder), ("threshold",), (0.5,), (1, 2), context=8, tokens=3, rounds=1, calib_text=str(tiny_text),
        head_sparsities=(0.0, 0.75), out=tmp_path, progress=lambda m: None,
    )  # fmt: skip
    assert [(r["selector"], r["head_sparsity"], r["batch"]) for r in bench] == [
        ("dense", 0.0, 1),
        ("threshold", 0.0, 1),
        ("threshold", 0.75, 1),
        ("dense", 0.0, 2),
        ("threshold", 0.0, 2),
        ("threshold", 0.75, 2),
    ]
    assert all(r["ms"] > 0 and r["bound"] > 0 for r in bench)
    assert bench[2]["mb"] < bench[1]["mb"] < bench[0]["mb"]
    assert bench[2]["heads"] == 0.25 and bench[1]["heads"] == 1.0
    heads = quality_curve(model, _ids(1, 200)[0], _ids(), ["oracle"], [0.0], seqlen=50, windows=3, head_sparsity=0.75)
    assert heads[1]["heads"] == 0.25 and heads[1]["kl"] > 0 and heads[1]["read"] < 1


def test_the_predictor_recovers_a_known_low_rank_rule():
    from sparsegen.contextual.predictor import PredictorSelector
    from sparsegen.contextual.selector import LayerStats

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=gen)
    rule = torch.randn(32, 4, generator=gen) @ torch.randn(4, 64, generator=gen)  # rank 4
    hidden = x @ rule + 100  # all positive: the largest |h| are the largest x @ rule
    selector = PredictorSelector(0.75, rank=8, steps=400, lr=1e-2)
    selector.calibrate(LayerStats(x, hidden, hidden))
    assert selector.recall > 0.9
    fresh = torch.randn(256, 32, generator=gen)
    truth = (fresh @ rule).topk(16, dim=-1).indices
    chosen = selector.keep(fresh, None, None)
    assert chosen.sum(-1).eq(16).all() and chosen.gather(1, truth).float().mean() > 0.9


def test_selectors_saved_in_a_model_folder_load_with_the_model(tiny_folder):
    import sparsegen

    model, _ = sparsegen.load(str(tiny_folder))
    selectors = sparsify(model, "threshold", 0.5, calibration=_ids(), progress=False)
    save_selectors(model, selectors, tiny_folder, "threshold", 0.5)
    with torch.no_grad():
        expected = model(_ids(1, 12, seed=6)).logits
    loaded, _ = sparsegen.load(str(tiny_folder))
    assert all(isinstance(layer.mlp, SparseMLP) for layer in decoder_layers(loaded))
    with torch.no_grad():
        torch.testing.assert_close(loaded(_ids(1, 12, seed=6)).logits, expected, rtol=0, atol=0)


def test_existence_counts_the_parts_a_token_needs():
    from sparsegen.contextual.existence import _needed, _static_error

    orthogonal = torch.eye(4)[None]  # four equal orthogonal parts: k kept leave sqrt(4 - k) / 2
    assert _needed(orthogonal, 0.6).item() == 3
    assert _needed(orthogonal, 0.75).item() == 2
    one_matters = torch.tensor([[[5.0, 0.0], [0.01, 0.0], [0.0, 0.01]]])
    assert _needed(one_matters, 0.1).item() == 1
    # tokens whose important part differs: the best fixed single part misses the other token's
    tokens = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 2.0]]])
    assert _static_error(tokens, 1) == pytest.approx(0.5)


def test_contextual_measure_writes_a_row_per_layer_and_plots(tiny_folder, tiny_text, tmp_path, monkeypatch, capsys):
    from tests.test_cli import run_cli

    out = tmp_path / "measure"
    args = ["contextual", "measure", "--model", tiny_folder, "--text", tiny_text, "--tokens", "40", "--out", out]
    code, _, stderr = run_cli(monkeypatch, capsys, *args)
    assert code == 0, stderr
    rows = json.loads((out / "contextual_measure.json").read_text())["rows"]
    assert len(rows) == len(decoder_layers(build_tiny("llama")))
    assert all(0 < r["neurons_needed"] <= 1 and 0 < r["heads_needed"] <= 1 for r in rows)
    assert rows[-1]["residual_cosine"] is None and -1 <= rows[0]["residual_cosine"] <= 1
    assert {p.name for p in out.glob("*.png")} == {"needed.png", "static_error.png", "residual_cosine.png"}
    code, _, stderr = run_cli(monkeypatch, capsys, *args, "--tolerance", "1.5")
    assert code != 0 and "--tolerance must be in (0, 1)" in stderr


def test_a_selectors_settings_are_saved_and_loaded_with_it(tmp_path):
    model = build_tiny("llama")
    selectors = sparsify(model, "predictor", 0.5, calibration=_ids(), progress=False, rank=8, steps=20)
    save_selectors(model, selectors, tmp_path, "predictor", 0.5)
    loaded = load_selectors(build_tiny("llama"), tmp_path)
    assert (loaded[0].rank, loaded[0].steps, loaded[0].sparsity) == (8, 20, 0.5)
    assert loaded[0].down.shape[1] == 8


def test_teals_batch_selection_is_a_checked_setting():
    from sparsegen.contextual import make_selector

    assert make_selector("teal", 0.5, batch_selection="shared").batch_selection == "shared"
    with pytest.raises(SparsegenError, match="batch_selection must be one of per-row, shared, got 'union'"):
        make_selector("teal", 0.5, batch_selection="union")
