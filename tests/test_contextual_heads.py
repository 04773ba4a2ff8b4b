"""Contextual head sparsity (Deja Vu's attention heads): kept heads equal the dense model, predictors round-trip."""

import json

import pytest
import torch

from sparsegen.contextual import densify, load_selectors, save_selectors, sparsify
from sparsegen.contextual.apply import (
    installed_heads,
    layer_kept_shares,
    read_bytes,
)
from sparsegen.contextual.heads import SparseAttention
from sparsegen.errors import SparsegenError
from sparsegen.models import decoder_layers
from tests.conftest import build_tiny

# The one table of neuron selectors the tests run over: how each one's MLP runs a decode step.
# "gathered": a SparseMLP reading only the kept neurons' rows; "masked": a SparseMLP computing
# every neuron (the choice needs h); "input-sparse": TEAL's projections. Adding a selector adds one
# row here.
from tests.test_contextual import _ids, assert_fast_path_equals_transformers


def test_all_heads_kept_generates_the_dense_tokens(arch):
    model = build_tiny(arch)
    prompt = _ids(1, 10, seed=1)
    dense = model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
    sparsify(model, "oracle", 0.0, calibration=_ids(), head_sparsity=0.01, progress=False)  # 4 heads: all kept
    assert all(isinstance(layer.self_attn, SparseAttention) for layer in decoder_layers(model))
    assert torch.equal(model.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0), dense)
    densify(model)
    assert not any(isinstance(m, SparseAttention) for m in model.modules())


@pytest.mark.parametrize("head_sparsity", [0.5, 0.75])  # 0.75 keeps 1 of 4 heads: queries one head at a time
def test_head_sparse_decode_steps_equal_the_teacher_forced_masked_path(arch, head_sparsity):
    model = build_tiny(arch)
    prompt = _ids(1, 10, seed=1)
    dense = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    sparsify(model, "oracle", 0.0, calibration=_ids(), head_sparsity=head_sparsity, progress=False)
    out = model.generate(
        prompt, max_new_tokens=8, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True
    )
    assert not torch.equal(out.sequences, dense)
    with torch.no_grad():  # every position at once: each token's own heads, skipped ones masked
        forced = model(out.sequences).logits[0, 9:-1]
    torch.testing.assert_close(torch.cat(out.scores), forced, rtol=1e-4, atol=1e-4)
    shares = layer_kept_shares(model, _ids(1, 8))
    assert shares.heads == [1 - head_sparsity] * len(shares.heads) and shares.neurons[0] == 1.0
    read, total = read_bytes(model, _ids(1, 8), shares)
    layer = decoder_layers(model)[0]
    q_o = 2 * layer.self_attn.original.q_proj.weight.numel() * 4 * len(shares.heads)
    skipped = head_sparsity * q_o if head_sparsity > 0.5 else head_sparsity * q_o / 2  # q is dense from half up
    assert total - read == pytest.approx(skipped)


def test_head_sparse_models_on_the_fast_path_equal_transformers_generate(arch):
    model = build_tiny(arch)
    sparsify(model, "predictor", 0.4, calibration=_ids(), head_sparsity=0.75, progress=False)
    assert_fast_path_equals_transformers(model)


def test_head_predictors_round_trip_and_report_recall(tmp_path):
    model = build_tiny("llama")
    selectors = sparsify(
        model, "predictor", 0.5, calibration=_ids(6, 32), head_sparsity=0.5, lookahead=True, progress=False
    )
    heads = installed_heads(model)
    assert all(0 <= h.recall <= 1 for h in heads) and torch.isnan(heads[0].lookahead_recall)
    assert all(0 <= h.lookahead_recall <= 1 for h in heads[1:])
    save_selectors(model, selectors, tmp_path, "predictor", 0.5)
    with torch.no_grad():
        expected = model(_ids(1, 12, seed=4)).logits
    fresh = build_tiny("llama")
    load_selectors(fresh, tmp_path)
    assert [h.sparsity for h in installed_heads(fresh)] == [0.5] * len(heads)
    with torch.no_grad():
        torch.testing.assert_close(fresh(_ids(1, 12, seed=4)).logits, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: sparsify(m, "oracle", 0.5, calibration=_ids(), head_sparsity=1.0), "head sparsity must be in"),
        (lambda m: sparsify(m, "oracle", 0.5, head_sparsity=0.5), "head sparsity needs calibration text"),
        (lambda m: sparsify(m, "teal", 0.5, calibration=_ids(), head_sparsity=0.5), "use a neuron selector other"),
    ],
)
def test_bad_head_settings_are_clear_errors(call, message):
    with pytest.raises(SparsegenError, match=message):
        call(build_tiny("llama"))


def test_contextual_train_reports_recall_per_layer_and_saves_head_predictors(
    tiny_folder, tiny_text, tmp_path, monkeypatch, capsys
):
    import sparsegen
    from tests.test_cli import run_cli

    out = tmp_path / "trained"
    args = ["contextual", "train", "--model", tiny_folder, "--selector", "predictor", "--calib-text", tiny_text,
            "--n-samples", "4", "--seqlen", "32", "--head-sparsity", "0.5", "--out", out]  # fmt: skip
    code, stdout, stderr = run_cli(monkeypatch, capsys, *args)
    assert code == 0, stderr
    rows = json.loads((out / "contextual_recall.json").read_text())["rows"]
    assert len(rows) == len(decoder_layers(build_tiny("llama"))) and "heads lookahead recall" in stdout
    assert all(0 <= r["neurons recall"] <= 1 and 0 <= r["heads recall"] <= 1 for r in rows)
    model, _ = sparsegen.load(str(tiny_folder))
    load_selectors(model, out)
    assert all(isinstance(layer.self_attn, SparseAttention) for layer in decoder_layers(model))
