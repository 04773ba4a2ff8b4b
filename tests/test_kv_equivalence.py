"""A policy whose budget covers the whole text must give exactly the dense model's logits."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.decode import generate, stream
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny
from tests.kv_reference import TABLE

LARGE = {name: row.large for name, row in TABLE.items()}


def _generate(model, ids, cache, **kw):
    with policy_attention(model):
        out = model.generate(
            ids,
            cache=cache,
            max_new_tokens=12,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            **kw,
        )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("policy", list(LARGE))
def test_generate_equals_dense_when_budget_covers_text(arch, attn, policy):
    model = build_tiny(arch, attn)
    ids = torch.randint(3, 96, (2, 17), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ref_seq, ref_logits = _generate(model, ids, DynamicCache(config=model.config), attention_mask=mask)
    for position in ("original", "rolling"):
        cache = make_cache(model, KVSpec.of(policy, position=position, **LARGE[policy]))
        seq, logits = _generate(model, ids, cache, attention_mask=mask)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", list(LARGE))
def test_sampling_equals_dense_with_same_seed(policy):
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    ref, _ = _generate(model, ids, DynamicCache(), do_sample=True, temperature=1.0)
    torch.manual_seed(5)
    seq, _ = _generate(
        model, ids, make_cache(model, KVSpec.of(policy, **LARGE[policy])), do_sample=True, temperature=1.0
    )
    assert torch.equal(seq, ref)


@pytest.mark.parametrize("chunk", [1, 5])
@pytest.mark.parametrize("policy", list(LARGE))
def test_stream_logits_equal_dense_forward(arch, policy, chunk):
    model = build_tiny(arch)
    ids = torch.randint(3, 96, (1, 23), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        dense = model(ids).logits
    steps = list(stream(model, ids, KVSpec.of(policy, **LARGE[policy]), chunk=chunk))
    logits = torch.cat([s.logits for s in steps], 1)
    torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)


def test_stream_continued_by_generate_equals_generate():
    model = build_tiny("qwen2")
    ids = torch.randint(3, 96, (1, 11), generator=torch.Generator().manual_seed(4))
    ref = model.generate(ids, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 11:]
    cache = make_cache(model, KVSpec.of("streaming", sinks=2, recent=100))
    assert len(list(stream(model, ids[:, :-1], chunk=4, cache=cache))) == 3
    made = generate(
        model, [ids[0, -1:].tolist()], 10, KVSpec.of("streaming", sinks=2, recent=100), compile="never", held=[cache]
    )
    assert made.tokens[0] == ref.tolist()


def test_cache_reused_across_chat_turns_equals_dense():
    model = build_tiny("llama")
    gen = torch.Generator().manual_seed(6)
    turn1 = torch.randint(3, 96, (1, 10), generator=gen)
    dense, policy = DynamicCache(), make_cache(model, KVSpec.of("h2o", heavy=100, recent=100))
    out_d = model.generate(turn1, cache=dense, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with policy_attention(model):
        out_p = model.generate(turn1, cache=policy, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out_d, out_p)
    turn2 = torch.randint(3, 96, (1, 6), generator=gen)
    out_d = model.generate(torch.cat([out_d, turn2], 1), cache=dense, max_new_tokens=5, do_sample=False, pad_token_id=0)
    with policy_attention(model):
        out_p = model.generate(
            torch.cat([out_p, turn2], 1), cache=policy, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    assert torch.equal(out_d, out_p)
    assert policy.physical_length() == dense.get_seq_length()
