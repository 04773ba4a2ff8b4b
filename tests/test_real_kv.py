"""The KV engine and streaming evaluation on the real default model (SmolLM2-135M)."""

import pytest
import torch
from transformers import LogitsProcessorList

from sparsegen.data import load_text, tokenize_long
from sparsegen.eval import PolicyRun, stream_compare
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import PhysicalLengthRecorder

pytestmark = pytest.mark.real


def _prompt(tokenizer, text="Tell me a long story about a dragon and a knight."):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )


@pytest.mark.parametrize(
    "policy,parts", [("streaming", {"sinks": 4, "recent": 252}), ("h2o", {"heavy": 128, "recent": 128})]
)
def test_generation_stays_within_budget(real, policy, parts):
    model, tokenizer = real
    encoded = _prompt(tokenizer)
    cache = make_cache(model, KVSpec.of(policy, **parts))
    lengths = PhysicalLengthRecorder(cache)
    with policy_attention(model):
        out = model.generate(
            **encoded,
            cache=cache,
            max_new_tokens=300,
            min_new_tokens=300,
            do_sample=False,
            logits_processor=LogitsProcessorList([lengths]),
        )
    assert out.shape[1] - encoded["input_ids"].shape[1] == 300
    assert len(lengths.lengths) == 300 and max(lengths.lengths) <= 256
    assert cache.get_seq_length() > 256


def test_budget_larger_than_text_is_identical_to_plain_generate(real):
    model, tokenizer = real
    encoded = _prompt(tokenizer, "What is the capital of France?")
    plain = model.generate(**encoded, max_new_tokens=40, do_sample=False)
    for policy, parts in [
        ("streaming", {"sinks": 4, "recent": 1000}),
        ("h2o", {"heavy": 500, "recent": 500}),
        ("streaming_h2o", {"sinks": 4, "heavy": 500, "recent": 500}),
    ]:
        with policy_attention(model):
            cache = make_cache(model, KVSpec.of(policy, **parts))
            sparse = model.generate(**encoded, max_new_tokens=40, do_sample=False, cache=cache)
        assert torch.equal(sparse, plain), policy


def test_sinks_rescue_window_attention(real):
    """The seeds' evidence in miniature: evicting the first tokens hurts, keeping 4 sinks fixes it."""
    model, tokenizer = real
    ids = tokenize_long(tokenizer, load_text("shakespeare"), max_tokens=1500)
    runs = [
        PolicyRun("full", "full"),
        PolicyRun("window", KVSpec.of("window", recent=256)),
        PolicyRun("streaming", KVSpec.of("streaming", sinks=4, recent=252)),
    ]
    results = stream_compare(model, ids, runs, chunk=32, reference="full", progress=False)
    full, window, streaming = (results[k].ppl for k in ("full", "window", "streaming"))
    assert streaming < 1.15 * full
    assert window > 1.3 * streaming
    assert results["streaming"].kl < results["window"].kl


def test_ruler_needle_on_the_real_model_one_prefill_equals_separate_reads(real, tmp_path):
    """RULER's single needle at 1k tokens: the full cache finds it, and every policy's answer from the
    shared prefill equals its answer from reading the context alone."""
    from sparsegen.eval.ruler import RulerSettings, ruler_job
    from sparsegen.kv import POLICIES

    model, tokenizer = real
    settings = RulerSettings("smollm2-135m", ("niah_single_1",), (1024,), 1, tuple(sorted(POLICIES)), (0.5,))
    shared = ruler_job(model, tokenizer, settings, tmp_path, progress=False)
    assert next(r["score"] for r in shared if r["policy"] == "full") == 100
    alone = ruler_job(model, tokenizer, RulerSettings(**{**vars(settings), "separate_prefill": True}), tmp_path, False)
    answers = [sorted((r["policy"], r["prediction"]) for r in run) for run in (alone, shared)]
    assert answers[0] == answers[1]
