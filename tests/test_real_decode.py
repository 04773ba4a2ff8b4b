"""The fast decode path on the real default model: transformers' generate() is the reference."""

import pytest
import torch

from sparsegen.data import load_text, tokenize_long
from sparsegen.decode import generate
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec

pytestmark = pytest.mark.real


def test_greedy_equals_transformers_generate(real):
    model, tokenizer = real
    ids = tokenize_long(tokenizer, load_text("shakespeare"), max_tokens=300)[None]
    with torch.inference_mode(), policy_attention(model):
        plain = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
        cache = make_cache(model, KVSpec.of("h2o", heavy=64, recent=64))
        sparse = model.generate(
            ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=24, do_sample=False
        )
    assert generate(model, ids, 24, compile="never", eos_token_id=[]).tokens[0] == plain[0, 300:].tolist()
    fast = generate(model, ids, 24, KVSpec.of("h2o", heavy=64, recent=64), compile="never", eos_token_id=[])
    assert fast.tokens[0] == sparse[0, 300:].tolist()


def test_padded_batch_of_four_gives_each_rows_single_output(real):
    model, tokenizer = real
    text = tokenize_long(tokenizer, load_text("shakespeare"), max_tokens=2000).tolist()
    prompts = [text[start : start + length] for start, length in ((0, 90), (400, 250), (900, 160), (1300, 400))]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    options = dict(kv=KVSpec.of("streaming", sinks=4, recent=124), compile="never", eos_token_id=[])
    batch = generate(model, ids, 16, attention_mask=mask, **options)
    assert batch.tokens == [generate(model, [p], 16, **options).tokens[0] for p in prompts]
