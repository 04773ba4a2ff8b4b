"""Expected Attention against transformers' own RoPE and a Monte Carlo draw of future queries."""

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparsegen.kv import PolicyLayer, make_cache, make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import Step
from sparsegen.kv.rope import KeyRotation
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny

N, SINKS, HEADS, KV_HEADS, D = 24, 2, 4, 2, 16


def _scores(covariance: bool, future: int):
    """The policy's scores on raw queries and keys rotated by the tiny Llama's RoPE, with what it saw."""
    rotary = build_tiny("llama").model.rotary_emb
    gen = torch.Generator().manual_seed(3)
    raw_queries = torch.randn(1, HEADS, N, D, generator=gen) + torch.linspace(-1, 1, D)
    raw_keys = torch.randn(1, KV_HEADS, N, D, generator=gen)
    cos, sin = rotary(raw_keys, torch.arange(N)[None])
    queries, keys = apply_rotary_pos_emb(raw_queries, raw_keys, cos, sin)
    settings = dict(sinks=SINKS, heavy=4, covariance=covariance, future=future, value_norm=False)
    layer = PolicyLayer(make_policy("expected_attention", **settings), rope=KeyRotation(rotary.inv_freq))
    held, _ = layer.update(keys, torch.ones(1, KV_HEADS, N, D))
    scores = layer.policy.score(_step(layer, queries, held))
    return scores, raw_queries[:, :, SINKS:], keys, rotary


def _step(layer, queries, keys):
    return Step(
        positions=layer.positions[:, :, : layer.size],
        keys=keys,
        values=layer.values[:, :, : layer.size],
        scores=layer.scores[:, :, : layer.size],
        query=queries,
        scaling=D**-0.5,
        seen=N,
        new=N,
        sizes=layer.policy.sizes(N),
        rope=layer.rope,
    )


def _at_next_position(raw, rotary):
    cos, sin = rotary(raw, torch.full((1, raw.shape[2]), N))
    return apply_rotary_pos_emb(raw, raw, cos, sin)[0]


def test_without_covariance_it_is_the_mean_query_at_the_next_position():
    scores, raw, keys, rotary = _scores(covariance=False, future=1)
    mean_query = _at_next_position(raw.mean(2, keepdim=True), rotary)  # [1, HEADS, 1, D]
    grouped_keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    logits = (mean_query @ grouped_keys.transpose(-1, -2))[:, :, 0] * D**-0.5
    logits[..., :SINKS] = float("-inf")
    expected = logits.softmax(-1).view(1, KV_HEADS, HEADS // KV_HEADS, N).mean(2)
    torch.testing.assert_close(scores, expected, rtol=1e-4, atol=1e-6)


def test_with_covariance_it_is_the_attention_gaussian_future_queries_give_on_average():
    scores, raw, keys, rotary = _scores(covariance=True, future=1)
    mean = raw.mean(2)[0]  # [HEADS, D]
    centred = raw[0] - mean[:, None]
    spread = centred.transpose(-1, -2) @ centred / centred.shape[1]
    draws = 200_000
    normal = torch.distributions.MultivariateNormal(mean.double(), spread.double() + 1e-9 * torch.eye(D))
    torch.manual_seed(0)
    samples = normal.sample((draws,)).float().permute(1, 0, 2)[None]  # [1, HEADS, draws, D]
    future = _at_next_position(samples, rotary)
    grouped_keys = keys.repeat_interleave(HEADS // KV_HEADS, dim=1)
    weight = ((future @ grouped_keys.transpose(-1, -2)) * D**-0.5).double().exp().mean(2)  # E[exp(s q.k)]
    weight[..., :SINKS] = 0
    expected = (weight / weight.sum(-1, keepdim=True)).view(1, KV_HEADS, HEADS // KV_HEADS, N).mean(2)
    torch.testing.assert_close(scores.double(), expected, rtol=0.03, atol=1e-4)


def test_sinks_are_kept_and_new_tokens_after_compression():
    model = build_tiny("qwen2")
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(2))
    cache = make_cache(model, KVSpec.of("expected_attention", budget=20))
    with policy_attention(model):
        model(ids, cache=cache)
        for layer in cache.policy_layers():
            held = layer.held_positions()
            assert held.shape[-1] == 20 and (held[..., :4] == torch.arange(4)).all()
        model(torch.tensor([[5]]), cache=cache)
    assert all(layer.size == 21 for layer in cache.policy_layers())
