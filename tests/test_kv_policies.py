"""Kept-token sets against brute force, rolling positions, bounds, and clear errors."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from sparsegen.errors import SparsegenError
from sparsegen.kv import POLICIES, PolicyLayer, make_cache, make_policy, resolve_budget
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.rope import KeyRotation
from sparsegen.kv.spec import KVSpec
from tests.conftest import COMMON, PhysicalLengthRecorder, build_tiny
from tests.kv_reference import EVICTING, INV_FREQ, TABLE, ReferenceCache

B, HKV, GROUP, D = 2, 2, 2, 8


def _drive(policy_name, parts, chunks, settings=None, seed=0):
    """Feed random keys/queries through a PolicyLayer and the brute-force reference side by side."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(chunks)
    keys = torch.randn(B, HKV, total, D, generator=gen, dtype=torch.float64).float()
    values = torch.randn(B, HKV, total, D, generator=gen)
    queries = torch.randn(B, HKV * GROUP, total, D, generator=gen)
    settings = settings or {}
    layer = PolicyLayer(make_policy(policy_name, **parts, **settings), rope=KeyRotation(INV_FREQ.float()))
    ref = ReferenceCache(policy_name, parts, B, HKV, settings)
    start = 0
    for n in chunks:
        held_keys, _ = layer.update(keys[:, :, start : start + n], values[:, :, start : start + n])
        layer.after_attention(queries[:, :, start : start + n], held_keys, D**-0.5)
        ref.step(keys, queries[:, :, start : start + n], values)
        start += n
        if TABLE[policy_name].bounded:  # (a policy compressing every N steps lets N - 1 in beyond its budget)
            assert layer.size <= ref.budget + settings.get("compress_every", 1) - 1
        held = layer.kept_positions()
        for b in range(B):
            for h in range(HKV):
                assert held[b][h] == sorted(ref.kept[b][h]), (b, h, start)
        _check_scores(layer, ref)
    return layer, ref


def _check_scores(layer, ref):
    valid = layer.size + (layer.hole is not None)
    for b in range(B):
        for column in range(layer.positions.shape[1]):  # one column of flat slots where heads share a budget
            for slot in range(valid):
                if layer.hole is not None and slot == layer.hole[b, column, 0]:
                    continue
                h = column if layer.head_of is None else int(layer.head_of[b, column, slot])
                pos = int(layer.positions[b, column, slot])
                score = layer.scores[b, column, slot].item()
                assert score == pytest.approx(ref.scores[b][h][pos], rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("policy", EVICTING)
def test_kept_sets_match_brute_force_token_by_token(policy):
    _drive(policy, TABLE[policy].small, [1] * 30)


@pytest.mark.parametrize("policy", EVICTING)
def test_kept_sets_match_brute_force_with_prefill_and_chunks(policy):
    _drive(policy, TABLE[policy].small, [12, 1, 1, 3, 1, 7, 1, 1, 2])


DECODING = [name for name in EVICTING if TABLE[name].bounded]


@pytest.mark.parametrize("policy", DECODING)
def test_compressing_every_few_steps_matches_brute_force(policy):
    """kvpress's decoding protocol: 3 tokens let in beyond the budget, then evicted at once."""
    layer, ref = _drive(policy, TABLE[policy].small, [12] + [1] * 13, settings={"compress_every": 4})
    assert layer.size == ref.budget + 1  # 13 steps after the prompt's compression: 3 full rounds, 1 let in


def test_normalized_h2o_matches_brute_force():
    _drive("h2o", {"heavy": 4, "recent": 2}, [9, 1, 1, 1, 4, 1, 1, 1, 1], settings={"normalize": True})


@settings(max_examples=40, deadline=None)
@given(
    policy=st.sampled_from(EVICTING),
    sinks=st.integers(1, 3),
    heavy=st.integers(0, 4),
    recent=st.integers(1, 5),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    seed=st.integers(0, 10_000),
)
def test_property_kept_sets_and_bounds(policy, sinks, heavy, recent, chunks, seed):
    _drive(policy, TABLE[policy].draw(sinks, heavy, recent), chunks, seed=seed)


@pytest.mark.parametrize("policy", EVICTING)
def test_rolling_keys_equal_rope_recomputed_at_cache_positions(policy):
    """Attention logits under rolling positions equal RoPE applied from scratch at positions 0..size-1."""
    model = build_tiny("llama")
    rotary = model.model.rotary_emb
    gen = torch.Generator().manual_seed(0)
    total = 40
    raw_keys = torch.randn(1, 2, total, 16, generator=gen)
    positions = torch.arange(total)[None]
    cos, sin = rotary(raw_keys, positions)
    _, rotated = apply_rotary_pos_emb(raw_keys, raw_keys, cos, sin)
    for chunks in ([1] * total, [9] + [1] * (total - 9)):
        layer = PolicyLayer(make_policy(policy, **TABLE[policy].small), KeyRotation(rotary.inv_freq))
        start = 0
        for n in chunks:
            t = start + n - 1
            held_keys, _ = layer.update(rotated[:, :, start : t + 1], rotated[:, :, start : t + 1])
            start += n
            # Positions within the cache: kept tokens in text order at 0..size-1, the query at size - 1 + 1.
            query_raw = torch.randn(1, 2, 1, 16, generator=gen)
            for h in range(2):
                slot_positions, head_keys = _head_view(layer, held_keys, h)
                order = slot_positions.argsort(-1)
                size = slot_positions.shape[-1]
                q_cos, q_sin = rotary(query_raw, torch.tensor([[size - 1]]))
                query_scratch, _ = apply_rotary_pos_emb(query_raw, query_raw, q_cos, q_sin)
                k_cos, k_sin = rotary(raw_keys, torch.arange(size)[None])
                kept_raw = raw_keys[:, h : h + 1, slot_positions[order]]
                _, scratch = apply_rotary_pos_emb(kept_raw, kept_raw, k_cos, k_sin)
                expected = (query_scratch[:, h : h + 1] @ scratch.transpose(-1, -2))[0, 0, 0]
                q_cos2, q_sin2 = rotary(query_raw, torch.tensor([[t]]))
                query_here, _ = apply_rotary_pos_emb(query_raw, query_raw, q_cos2, q_sin2)
                ours = (query_here[:, h : h + 1] @ head_keys[:, :, order].transpose(-1, -2))[0, 0, 0]
                torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
            layer.after_attention(torch.randn(1, 2, n, 16, generator=gen), held_keys, 0.25)


def _head_view(layer, held_keys, h):
    """KV head `h`'s held positions [n] and keys [1, 1, n, d], whether its layer keeps heads apart or flat."""
    if layer.head_of is None:
        return layer.positions[0, h, : layer.size], held_keys[:, h : h + 1]
    mine = layer.head_of[0, 0, : layer.size] == h
    return layer.positions[0, 0, : layer.size][mine], held_keys[:, :, mine]


@pytest.mark.parametrize("policy", EVICTING)
def test_generate_keeps_physical_length_within_budget(arch, policy):
    model = build_tiny(arch)
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(0))
    budget = 16
    cache = make_cache(model, KVSpec.of(policy, budget=budget))
    recorder = PhysicalLengthRecorder(cache)
    with policy_attention(model):
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            cache=cache,
            max_new_tokens=40,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([recorder]),
        )
    lengths = [n if isinstance(n, int) else max(n) for n in recorder.lengths]
    if not TABLE[policy].bounded:  # compressed once after the prompt, then every new token is kept
        layers = cache.policy_layers()
        assert [layer.tokens_per_head for layer in layers] == [layer.sizes.budget + 39 for layer in layers]
        if arch != "gemma3":  # every layer holds a policy: the layers' budgets average the budget
            assert sum(layer.sizes.budget for layer in layers) == budget * len(layers)
        if policy != "pyramidkv":
            assert lengths == [budget + step for step in range(40)]
        return
    assert len(lengths) == 40 and max(lengths) <= budget
    for layer in cache.policy_layers():
        held = layer.held_positions()
        assert held.shape[-1] == budget
        if policy == "window":
            assert held[0, 0].tolist() == list(range(69 - 16, 69))
        if policy == "streaming":
            assert held[0, 0].tolist() == [0, 1, 2, 3, *range(69 - 12, 69)]


def test_pyramidkv_budgets_shrink_with_depth_and_hold_their_bytes():
    model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": 5})).eval()
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(1))
    cache = make_cache(model, KVSpec.of("pyramidkv", heavy=96, recent=4))
    with policy_attention(model):
        model(ids, cache=cache)
    sizes = [layer.size for layer in cache.policy_layers()]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 2 * sizes[-1]
    assert sum(sizes) == 100 * 5
    per_token = 2 * COMMON["num_key_value_heads"] * (COMMON["hidden_size"] // COMMON["num_attention_heads"]) * 4
    assert cache.kv_bytes() == sum(sizes) * per_token


@pytest.mark.parametrize("policy", EVICTING)
def test_batch_rows_match_single_row_runs(policy):
    model = build_tiny("mistral")
    ids = torch.randint(3, 96, (3, 20), generator=torch.Generator().manual_seed(9))
    with policy_attention(model):
        batch = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=15,
            do_sample=False,
            pad_token_id=0,
            cache=make_cache(model, KVSpec.of(policy, **TABLE[policy].small)),
        )
    for row in range(3):
        with policy_attention(model):
            single = model.generate(
                ids[row : row + 1],
                max_new_tokens=15,
                do_sample=False,
                pad_token_id=0,
                cache=make_cache(model, KVSpec.of(policy, **TABLE[policy].small)),
            )
        length = single.shape[1]  # a row that met the end token is padded in the batch
        assert torch.equal(batch[row, :length], single[0]) and (batch[row, length:] == 0).all()


@pytest.mark.parametrize("policy", EVICTING)
def test_padded_batch_is_refused(policy):
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (2, 10))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with pytest.raises(SparsegenError, match="padded batches"), policy_attention(model):
        model.generate(
            ids,
            attention_mask=mask,
            cache=make_cache(model, KVSpec.of(policy, **TABLE[policy].small)),
            max_new_tokens=3,
            pad_token_id=0,
        )


def test_model_without_rotary_positions_is_refused():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)).eval()
    with pytest.raises(SparsegenError, match="no rotary position embedding"):
        make_cache(model, "streaming")


def test_unsupported_attention_implementation_is_refused():
    model = build_tiny("llama")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(SparsegenError, match="attn_implementation='sdpa' or 'eager'"):
        make_cache(model, KVSpec.of("window", recent=8))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: make_policy("window", recent=-1), "must be >= 0"),
        (lambda: make_policy("h2o", heavy=0, recent=0), "heavy \\+ recent > 0"),
        (lambda: make_policy("streaming_h2o", sinks=4, heavy=0, recent=0), "heavy \\+ recent > 0"),
        (lambda: make_policy("streaming", sinks=4, recent=0), "recent > 0"),
        (lambda: make_policy("streaming", budget=4, sinks=4), "sinks \\(4\\) must be smaller than the budget \\(4\\)"),
        (lambda: make_policy("streaming_h2o", budget=3, sinks=8), "must be smaller than the budget"),
        (lambda: make_policy("window", budget=8, sinks=2), "keeps no sinks"),
        (lambda: make_policy("snapkv", kernel=4), "odd kernel"),
        (lambda: make_policy("tova", heavy=8, recent=2), "unexpected keyword argument 'recent'"),
        (lambda: make_policy("h2o", heavy=1.5, recent=0.1), "ratio of the prompt and must be < 1"),
        (lambda: make_policy("nope"), "unknown KV policy 'nope'"),
        (lambda: make_policy("window", budget=0), "budget must be an int > 0"),
        (lambda: make_policy("window", recent="8"), "must be a number"),
    ],
)
def test_bad_budgets_are_clear_errors(call, message):
    with pytest.raises(SparsegenError, match=message):
        call()


def test_every_policy_has_a_row_in_the_table():
    assert set(TABLE) == set(POLICIES)


def test_one_budget_rule_splits_a_total():
    assert resolve_budget("streaming_h2o", None, 21, {}) == {"sinks": 4, "heavy": 8, "recent": 9}
    assert resolve_budget("streaming", None, 6, {"heavy": None}) == {"sinks": 4, "recent": 2}  # None: not given
    assert resolve_budget("streaming", None, 4, {}) == {"sinks": 2, "recent": 2}  # no room for the default 4
    assert resolve_budget("snapkv", None, 100, {}) == {"heavy": 68, "recent": 32}
    assert resolve_budget("streaming", None, 0.2, {"sinks": 2}) == {"sinks": 2, "recent": 0.2}  # sinks on top
    assert resolve_budget("streaming", 100, 0.2, {"sinks": 2}) == {"sinks": 2, "recent": 18}  # sinks within
    assert make_policy("h2o", budget=0.2).resolved(50) == make_policy("h2o", heavy=5, recent=5)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: make_policy("h2o", budget=8, heavy=2), "give a total budget .* or its parts .*, not both"),
        (lambda: resolve_budget("h2o", 100, 0.2, {"recent": 0.1}), "not both"),
        (lambda: make_policy("window", sinks=2, recent=8), "policy 'window' keeps no sinks; drop --sinks"),
        (lambda: resolve_budget("snapkv", 100, 64, {"sinks": 4}), "policy 'snapkv' keeps no sinks"),
        (lambda: resolve_budget("streaming", 100, 8, {"sinks": 8}), "sinks \\(8\\) must be smaller"),
        (lambda: make_policy("snapkv", budget=0.5), "observation window is a token count"),
    ],
)
def test_conflicting_budget_parts_are_one_error(call, message):
    with pytest.raises(SparsegenError, match=message):
        call()


def test_ratio_budget_resolves_against_the_prompt():
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 50))
    cache = make_cache(model, KVSpec.of("h2o", heavy=0.1, recent=0.1))
    with policy_attention(model):
        model.generate(ids, cache=cache, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert cache.physical_length() == 10
    assert cache.policy_layers()[0].sizes.heavy == 5


def test_key_rotation_by_any_delta_equals_rope_at_that_position():
    """Rotating a raw key by d equals RoPE at position d, for deltas past the looked-up table's
    first reach and after it has grown (negative ones are RoPE's inverse)."""
    rotary = build_tiny("llama").model.rotary_emb
    rotation = KeyRotation(rotary.inv_freq)
    raw = torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(0))
    for reach in (100, 5000, 300):
        delta = torch.randint(0, reach, (64,), generator=torch.Generator().manual_seed(reach))
        cos, sin = rotary(raw, delta[None])
        _, expected = apply_rotary_pos_emb(raw, raw, cos, sin)
        delta = delta.expand(1, 2, 64)
        torch.testing.assert_close(rotation.rotate(raw, delta), expected, rtol=1e-4, atol=1e-4)
        back = rotation.rotate(rotation.rotate(raw, delta), -delta)
        torch.testing.assert_close(back, raw, rtol=1e-4, atol=1e-4)
