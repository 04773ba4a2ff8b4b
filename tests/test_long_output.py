"""Fidelity along the full cache's own output (`eval.long_output`), against a teacher-forced read of
the drop-in cache and the dense forward in float64."""

import pytest
import torch

from sparsegen.decode.reading import read
from sparsegen.errors import SparsegenError
from sparsegen.eval.long_output import follow_full_output, long_output_prompt
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
    assert len(long_output_prompt(tokenizer, "code", "shakespeare")) > 0
    with pytest.raises(SparsegenError, match="text or code"):
        long_output_prompt(tokenizer, "poem", "shakespeare")
