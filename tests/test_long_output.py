"""Fidelity along the full cache's own output (`eval.long_output`), against a teacher-forced read of
the drop-in cache and the dense forward in float64."""

import json

import pytest
import torch

from sparsegen.decode.reading import read
from sparsegen.errors import SparsegenError
from sparsegen.eval.long_output import CODE_REQUEST, follow_full_output, long_output_prompt
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny, tiny_tokenizer


def test_agreement_and_kl_equal_a_teacher_forced_drop_in_cache_against_the_dense_model():
    model = build_tiny("llama")
    prompt, tokens = [5, 9, 14, 3, 22, 7, 31, 2, 8, 40, 12, 6], 24
    runs = {"small": {"policy": "h2o", "budget": 6}, "whole": {"policy": "h2o", "budget": 100}}
    written, rows = follow_full_output(model, prompt, tokens, runs, segment=8)
    ids = torch.tensor([prompt + written])
    with torch.no_grad():
        dense = model(ids).logits[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    assert written == dense.argmax(-1).tolist()  # the full cache wrote the dense model's greedy text
    cache = make_cache(model, KVSpec.of("h2o", budget=6))
    with policy_attention(model), torch.inference_mode():
        logits = [read(model, prompt, cache)] + [read(model, [token], cache) for token in written[:-1]]
    mine = torch.stack(logits).double().log_softmax(-1)
    agree = (mine.argmax(-1) == torch.tensor(written)).tolist()
    kl = (dense.exp() * (dense - mine)).sum(-1)
    small, whole = rows
    assert small["agreement"] == sum(agree) / tokens and small["kl_mean"] > 1e-3  # it evicted
    assert small["agreement_by_segment"] == [sum(agree[i : i + 8]) / 8 for i in range(0, tokens, 8)]
    assert small["kl_mean"] == pytest.approx(kl.mean().item(), rel=1e-3, abs=1e-6)
    assert whole["agreement"] == 1 and whole["kl_mean"] == pytest.approx(0, abs=1e-6)


def test_prompts_and_their_errors():
    tokenizer = tiny_tokenizer()
    ids = long_output_prompt(tokenizer, "code", "shakespeare")
    words = [word if word in tokenizer.get_vocab() else "w3" for word in CODE_REQUEST.split()] + ["w4"]
    assert ids == [tokenizer.get_vocab()[word] for word in words]  # the template's words, then its turn marker
    with pytest.raises(SparsegenError, match="text or code"):
        long_output_prompt(tokenizer, "poem", "shakespeare")


def test_the_command_records_the_dense_models_greedy_output_where_it_stops_and_reads_a_finished_run_back(
    monkeypatch, capsys, tiny_folder, tmp_path
):
    from transformers import AutoModelForCausalLM

    from tests.test_cli import run_cli

    args = ("eval", "long-output", "--model", tiny_folder, "--prompt", "code", "--tokens", 16)
    args += ("--policies", "h2o", "--budget", "0.5", "--out", tmp_path)
    code, out, _ = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and "| h2o | 8 |" in out
    result = json.loads((tmp_path / "long_output.json").read_text())
    tokenizer = tiny_tokenizer()
    prompt = long_output_prompt(tokenizer, "code", "shakespeare")
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, attn_implementation="eager").eval()
    with torch.no_grad():  # the dense forward's argmax, token by token, no cache
        ids = torch.tensor([prompt])
        for _ in range(16):
            ids = torch.cat([ids, model(ids).logits[:, -1:].argmax(-1)], -1)
    written = ids[0, len(prompt) :].tolist()
    assert result["written"] == written
    stops = {tokenizer.eos_token_id, model.generation_config.eos_token_id} - {None}
    assert result["first_stop_token_at"] == next((i for i, token in enumerate(written) if token in stops), None)
    (tmp_path / "long_output.md").unlink()
    code, out, _ = run_cli(monkeypatch, capsys, *args)  # the same settings: read back, not run again
    assert code == 0 and "| h2o | 8 |" in out and not (tmp_path / "long_output.md").exists()
