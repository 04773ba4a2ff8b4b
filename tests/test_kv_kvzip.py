"""KVzip: kept sets equal a brute-force reference built from transformers' own attention weights
over the context followed by its re-read chunk; the fast path, the drop-in cache and one prefill for
many budgets agree; what it cannot do is a one-line error."""

import pytest
import torch

from sparsegen.decode import generate
from sparsegen.decode.kvzip_read import RepeatFrame, repeat_frame
from sparsegen.decode.reading import read
from sparsegen.decode.shared import SharedPrefill
from sparsegen.errors import SparsegenError
from sparsegen.kv import make_cache, make_policy, policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import ARCHS, build_tiny, tiny_tokenizer
from tests.kv_reference import generate_drop_in


def _written_over_hidden(model, layer: int, out, n: int) -> torch.Tensor:
    """KVzip+'s weight [hq, re-read queries, every key], float64: ||W_j v|| of every key's value
    through query head j's columns of o_proj, over the norm of each re-read query's normed hidden state."""
    block = model.model.layers[layer]
    d = block.self_attn.head_dim
    values = out.past_key_values.layers[layer].values[0].double()  # [hkv, keys, d]
    weight = block.self_attn.o_proj.weight.double()
    heads = weight.shape[1] // d
    group = heads // values.shape[0]
    written = torch.stack([(values[j // group] @ weight[:, j * d : (j + 1) * d].T).norm(dim=-1) for j in range(heads)])
    hidden = block.input_layernorm(out.hidden_states[layer])[0, n:].double().norm(dim=-1)
    return written[:, None, :] / hidden[None, :, None]


def _reference_scores(
    model,
    ids: list[int],
    chunk: int,
    cue: int,
    scoped: int | None = None,
    frame: RepeatFrame | None = None,
    weighed: bool = False,
) -> dict[int, torch.Tensor]:
    """Per full-attention layer, float64 [h, n]: every chunk re-read after the context in one dense
    eager forward (inside `frame`'s words where given); a token scores the most attention any query
    of its group gave it while its chunk was re-read (with `scoped`, each query's attention divided
    by what it gave the first `scoped` tokens, the chunk and the re-read's own tokens, each once;
    `weighed`, then times `_written_over_hidden`)."""
    config = model.config.get_text_config(decoder=True)
    n, group = len(ids), config.num_attention_heads // config.num_key_value_heads
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    scores = {i: torch.zeros(config.num_key_value_heads, n, dtype=torch.float64) for i, t in enumerate(types)}
    for start in range(0, n, chunk):
        stop, cued = min(n, start + chunk), ids[max(0, start - cue) : start]
        again = cued + ids[start:stop]
        if frame is not None:
            again = list(frame.first if start == 0 else frame.later) + cued + list(frame.turn) + ids[start:stop]
        with torch.inference_mode():
            out = model(torch.tensor([ids + again]), output_attentions=True, output_hidden_states=weighed)
            for layer in scores:
                seen = out.attentions[layer][0, :, n:].double()  # [hq, re-read queries, every key]
                if scoped is not None:
                    scope = [*range(min(scoped, start)), *range(start, stop), *range(n, n + len(again))]
                    seen = seen / seen[..., scope].sum(-1, keepdim=True)
                if weighed and types[layer] == "full_attention":  # (a sliding layer's scores are dropped)
                    seen = seen * _written_over_hidden(model, layer, out, n)
                seen = seen[..., start:stop]  # [hq, re-read queries, chunk keys]
                grouped = seen.reshape(config.num_key_value_heads, group * seen.shape[1], stop - start)
                scores[layer][:, start:stop] = grouped.amax(1)
    return {layer: score for layer, score in scores.items() if types[layer] == "full_attention"}


def _heavy_per_layer(scores: dict[int, torch.Tensor], sinks: int, heavy: int, pool: str) -> dict[int, int]:
    """Tokens per head each layer keeps by score: `heavy` everywhere, or (one model-wide pool) the
    layer's count among the model's best `heavy * h * layers` non-sink slots over h, rounded to
    whole tokens by largest remainders."""
    if pool == "layer":
        return dict.fromkeys(scores, heavy)
    heads = len(next(iter(scores.values())))
    slots = [
        (float(score[h, p]), layer)
        for layer, score in scores.items()
        for h in range(heads)
        for p in range(sinks, score.shape[1])
    ]
    best = sorted(slots, reverse=True)[: heavy * heads * len(scores)]
    shares = {layer: sum(1 for _, at in best if at == layer) / heads for layer in scores}
    counts = {layer: int(share) for layer, share in shares.items()}
    by_remainder = sorted(scores, key=lambda layer: shares[layer] - counts[layer], reverse=True)
    for layer in by_remainder[: heavy * len(scores) - sum(counts.values())]:
        counts[layer] += 1
    return counts


def _reference_kept(model, ids: list[int], sinks: int, heavy: int, chunk: int, cue: int, pool: str, **reread):
    """Per full-attention layer, the positions each KV head keeps: the layer's heads' best
    `sinks + heavy` per head together (its heavy count from `_heavy_per_layer`), the first `sinks`
    always."""
    scores = _reference_scores(model, ids, chunk, cue, **reread)
    counts = _heavy_per_layer(scores, sinks, heavy, pool)
    kept = {}
    for layer, score in scores.items():
        slots = [(h, pos) for h in range(len(score)) for pos in range(len(ids))]
        ranked = sorted(((float("inf") if p < sinks else float(score[h, p]), h, p) for h, p in slots), reverse=True)
        ranked = ranked[: (sinks + counts[layer]) * len(score)]
        kept[layer] = [sorted(pos for _, head, pos in ranked if head == h) for h in range(len(score))]
    return kept


@pytest.mark.parametrize("pool", ("model", "layer"))
@pytest.mark.parametrize("arch", ARCHS)
def test_kept_sets_equal_the_brute_force_reconstruction(arch, pool):
    model = build_tiny(arch, "eager")
    ids = torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    for chunk, cue in ((64, 8), (16, 3)):  # one re-read, and three chunks with cues
        cache = make_cache(model, KVSpec.of("kvzip", sinks=2, heavy=9, chunk=chunk, cue=cue, pool=pool, scope="cache"))
        read(model, ids, cache)
        expected = _reference_kept(model, ids, 2, 9, chunk, cue, pool)
        held = [sum(map(len, layer.kept_positions()[0])) for layer in cache.policy_layers()]
        for layer in cache.policy_layers():
            assert layer.kept_positions()[0] == expected[layer.layer_idx], (arch, chunk, layer.layer_idx)
        assert sum(held) == 11 * cache.policy_layers()[0].kv_heads * len(held)  # the budget's total, however pooled
        assert (len(set(held)) == 1) == (pool == "layer") or len(held) == 1, held


@pytest.mark.parametrize("arch", ARCHS)
def test_the_papers_reread_chunk_scoped_and_asked_keeps_the_brute_force_sets(arch):
    model = build_tiny(arch, "eager")
    ids = torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(8)).tolist()
    frame = RepeatFrame(first=(5, 6, 7), later=(8, 9), turn=(10, 11))
    shared = SharedPrefill(model, ids, frame)
    for instructed in (False, True):
        spec = KVSpec.of("kvzip", sinks=2, heavy=9, chunk=16, cue=3, scope="chunk", instructed=instructed)
        cache = shared.cache_for(spec)
        expected = _reference_kept(model, ids, 2, 9, 16, 3, "model", scoped=2, frame=frame if instructed else None)
        for layer in cache.policy_layers():
            assert layer.kept_positions()[0] == expected[layer.layer_idx], (arch, instructed, layer.layer_idx)
    bare = _reference_kept(model, ids, 2, 9, 16, 3, "model")
    assert any(bare[layer] != expected[layer] for layer in bare)  # the frame and the scope choose other tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_kvzip_plus_weighs_by_what_values_write_as_the_brute_force_reference(arch):
    model = build_tiny(arch, "eager")
    generator = torch.Generator().manual_seed(10)
    with torch.no_grad():  # norm weights of ones give every token's normed hidden state the same norm
        for block in model.model.layers:
            block.input_layernorm.weight.copy_(torch.rand(block.input_layernorm.weight.shape, generator=generator) * 2)
    ids = torch.randint(3, 96, (37,), generator=torch.Generator().manual_seed(9)).tolist()
    spec = KVSpec.of("kvzip", sinks=2, heavy=9, chunk=16, cue=3, output_norms=True)
    cache = make_cache(model, spec)
    read(model, ids, cache)
    expected = _reference_kept(model, ids, 2, 9, 16, 3, "model", scoped=2, weighed=True)
    for layer in cache.policy_layers():
        assert layer.kept_positions()[0] == expected[layer.layer_idx], (arch, layer.layer_idx)
    plain = _reference_kept(model, ids, 2, 9, 16, 3, "model", scoped=2)
    assert any(plain[layer] != expected[layer] for layer in plain)  # the weights choose other tokens
    assert not any(block.self_attn._forward_pre_hooks for block in model.model.layers)  # the hooks are gone


def test_an_instructed_kvzip_asks_in_the_tokenizers_words_through_generate_and_the_server():
    import threading

    from sparsegen.serve.batching import Engine
    from sparsegen.serve.events import Done, Failed
    from sparsegen.serve.jobs import GenerationRequest

    model, tokenizer = build_tiny("qwen2"), tiny_tokenizer()
    prompt = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    spec, frame = KVSpec.of("kvzip", budget=10, chunk=12, instructed=True), repeat_frame(tokenizer)
    asked, bare = make_cache(model, spec), make_cache(model, KVSpec.of("kvzip", budget=10, chunk=12))
    expected = generate_drop_in(model, torch.tensor([prompt]), asked, 12, frame)
    read(model, prompt, bare)
    assert any(a.kept_positions() != b.kept_positions() for a, b in zip(asked.layers, bare.layers, strict=True))
    fast = generate(model, [prompt], 12, spec, compile="never", tokenizer=tokenizer, eos_token_id=[]).tokens[0]
    assert fast == expected
    stopping = generate(model, [prompt], 12, spec, compile="never", tokenizer=tokenizer).tokens[0]
    engine, ended, events = Engine(model, tokenizer, spec), threading.Event(), []
    try:
        engine.submit(
            GenerationRequest(prompt, 12, spec),
            lambda e: (events.append(e), isinstance(e, (Done, Failed)) and ended.set()),
        )
        assert ended.wait(60) and isinstance(events[-1], Done), events[-1]
    finally:
        engine.close()
    assert events[-1].text == tokenizer.decode(stopping, skip_special_tokens=True)


def test_the_fast_path_equals_the_drop_in_cache_after_read_and_rows_equal_single_runs():
    model = build_tiny("qwen2")
    prompts = [torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(s)).tolist() for s in (1, 2)]
    policy = make_policy("kvzip", budget=10, chunk=12)
    batch = generate(model, prompts, 16, policy, compile="never", eos_token_id=[]).tokens
    for row, prompt in enumerate(prompts):
        single = generate(model, [prompt], 16, policy, compile="never", eos_token_id=[]).tokens[0]
        drop_in = generate_drop_in(model, torch.tensor([prompt]), make_cache(model, policy), 16)
        assert batch[row] == single == drop_in


def test_one_prefill_reconstructs_once_for_every_budget(monkeypatch):
    import sparsegen.decode.shared as shared_module

    calls = []
    real = shared_module.reconstruct
    monkeypatch.setattr(shared_module, "reconstruct", lambda *a: calls.append(1) or real(*a))
    model = build_tiny("mistral")
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    shared = SharedPrefill(model, ids)
    for budget in (8, 16, 24):
        replayed = shared.cache_for(make_policy("kvzip", budget=budget))
        alone = make_cache(model, make_policy("kvzip", budget=budget))
        read(model, ids, alone)
        for mine, theirs in zip(replayed.policy_layers(), alone.policy_layers(), strict=True):
            assert mine.kept_positions() == theirs.kept_positions()
            assert torch.equal(mine.keys[:, :, : mine.size], theirs.keys[:, :, : theirs.size])
    assert len(calls) == 1 + 3  # the shared context once, each separate read once


def test_the_cache_holds_its_budgets_bytes():
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 80), generator=torch.Generator().manual_seed(5))
    cache = make_cache(model, KVSpec.of("kvzip", budget=20))
    generate_drop_in(model, ids, cache, 6)
    layers = cache.policy_layers()
    per_slot = 2 * layers[0].keys.shape[-1] * 4
    budget_bytes = (20 + 5) * layers[0].kv_heads * len(layers) * per_slot  # 5 tokens fed after the prompt
    assert cache.kv_bytes() == budget_bytes
    allocated = sum(layer.keys.numel() + layer.values.numel() for layer in layers) * 4
    assert allocated <= 1.1 * budget_bytes


def test_what_kvzip_cannot_do_is_a_one_line_error():
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(6))
    refused = pytest.raises(SparsegenError, match=r"re-reading it: read the prompt with sparsegen\.decode\.read")
    with refused, policy_attention(model):
        model.generate(ids, cache=make_cache(model, KVSpec.of("kvzip", budget=8)), max_new_tokens=2, do_sample=False)
    with pytest.raises(SparsegenError, match="drop the prompt's logprobs"):
        read(model, ids, make_cache(model, KVSpec.of("kvzip", budget=8)), all_logits=True)
    with pytest.raises(SparsegenError, match="chunk >= 1"):
        make_policy("kvzip", chunk=0)
    with pytest.raises(SparsegenError, match="pool is one of model, layer, got 'heads'"):
        make_policy("kvzip", pool="heads")
    with pytest.raises(SparsegenError, match="scope is one of cache, chunk, got 'all'"):
        make_policy("kvzip", scope="all")
    with pytest.raises(SparsegenError, match=r"instructed=True asks the model to repeat .* give the tokenizer"):
        read(model, ids, make_cache(model, KVSpec.of("kvzip", budget=8, instructed=True)))
    roomy = make_cache(model, KVSpec.of("kvzip", budget=64))  # nothing to evict: model.generate needs no re-reading
    assert len(generate_drop_in(model, ids, roomy, 4)) == 4


@pytest.mark.parametrize("group", (1, 3))
def test_the_one_pass_reread_attends_as_sdpa_and_scores_as_attention_received(group):
    from sparsegen.kv.kvzip import attention_and_peaks

    generator = torch.Generator().manual_seed(11)
    query = torch.randn(2, 2 * group, 300, 16, generator=generator)
    keys, values = (torch.randn(2, 2, 700, 16, generator=generator) for _ in range(2))
    out, peak = attention_and_peaks(query, keys, values, 0.25)
    held = torch.ones(300, 400, dtype=torch.bool)
    mask = torch.cat([held, torch.ones(300, 300, dtype=torch.bool).tril()], dim=1)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), attn_mask=mask, scale=0.25
    )
    assert out.shape == (2, 300, 2 * group, 16)
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-5)
    scores = query.double() @ keys.double().repeat_interleave(group, 1).transpose(-1, -2) * 0.25
    probabilities = scores.masked_fill(~mask, float("-inf")).softmax(-1)  # float64, by hand
    most = probabilities.view(2, 2, group, 300, 700).amax(dim=(2, 3))  # over the group's heads and queries
    torch.testing.assert_close(peak, most.float(), rtol=1e-5, atol=1e-7)


def test_rows_that_keep_different_counts_hold_their_own_slots_and_free_ones():
    from sparsegen.kv import ragged
    from sparsegen.kv.store import EMPTY

    priority = torch.tensor([[[5.0, 1, 4], [2, 6, 0]], [[9, 8, 7], [3, 2, 1]]])  # [b=2, h=2, n=3]
    keep = ragged.select_across_heads(priority, torch.tensor([2, 1]).view(2, 1, 1))
    assert keep.tolist() == [[[True, False, True], [True, True, False]], [[True, True, False], [False] * 3]]
    positions = torch.arange(3).expand(2, 2, 3)
    packed = ragged.pack({"positions": positions, "scores": priority}, keep)
    assert packed["positions"][:, 0].tolist() == [[0, 2, 0, 1], [0, 1, EMPTY, EMPTY]]
    assert packed["scores"][0, 0, :4].tolist() == [5, 4, 2, 6] and packed["scores"][1, 0, :2].tolist() == [9, 8]
    assert packed["head_of"][:, 0].tolist() == [[0, 0, 1, 1], [0, 0, 0, 1]]  # free slots tagged by heads in turn
    assert ragged.per_head(packed["head_of"], packed["positions"], 2) == [[[0, 2], [0, 1]], [[0, 1], []]]
