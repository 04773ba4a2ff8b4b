"""One prefill, many policies: a replayed cache equals the cache a policy makes reading alone."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.kv import PolicyLayer, make_cache, make_policy
from sparsegen.kv.shared import SharedPrefill
from sparsegen.kv.stream import read
from tests.conftest import ARCHS, build_tiny
from tests.kv_reference import TABLE


def _same_layers(replayed, alone) -> None:
    for mine, theirs in zip(replayed.layers, alone.layers, strict=True):
        if not isinstance(mine, PolicyLayer):
            assert torch.equal(mine.keys, theirs.keys) and mine.cumulative_length == theirs.cumulative_length
            continue
        assert (mine.size, mine.cumulative_length, mine.compressed) == (
            theirs.size,
            theirs.cumulative_length,
            theirs.compressed,
        )
        assert mine.kept_positions() == theirs.kept_positions()
        held = slice(0, mine.size + (mine.hole is not None))
        for name in ("keys", "values", "positions", "scores"):
            assert torch.equal(getattr(mine, name)[:, :, held], getattr(theirs, name)[:, :, held]), name


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_replayed_caches_equal_separate_reads_for_every_policy(arch, attn):
    model = build_tiny(arch, attn)
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    shared = SharedPrefill(model, ids)
    for name in TABLE:
        for budget in (8, 20):
            policy = make_policy(name, budget=budget) if name != "full" else make_policy(name)
            replayed = shared.cache_for(policy)
            alone = make_cache(model, policy.resolved(len(ids)))
            logits = read(model, ids, alone)
            assert torch.equal(logits, shared.logits)
            _same_layers(replayed, alone)
            question = [5, 6, 7]
            mine = generate(model, [question], 6, policy, compile="never", held=[replayed]).tokens
            theirs = generate(model, [question], 6, policy, compile="never", held=[alone]).tokens
            assert mine == theirs, (name, budget)


def test_rows_of_different_budgets_decode_as_their_single_runs():
    """The RULER job decodes one policy's ratios as rows of one batch."""
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (48,), generator=torch.Generator().manual_seed(5)).tolist()
    shared = SharedPrefill(model, ids)
    policies = [make_policy("h2o", budget=b) for b in (6, 12, 24)]
    batch = generate(
        model, [[9, 10]] * 3, 8, policies[0], compile="never", held=[shared.cache_for(p) for p in policies]
    )
    for policy, tokens in zip(policies, batch.tokens, strict=True):
        single = generate(model, [[9, 10]], 8, policy, compile="never", held=[shared.cache_for(policy)])
        assert single.tokens[0] == tokens


def test_a_prompt_compressed_once_is_read_whole_whatever_the_chunk():
    """A prefill-only policy chooses once: reading its prompt in chunks (the server's prefill) must
    not let it choose after the first chunk and keep the rest whole."""
    model = build_tiny("qwen2")
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(8)).tolist()
    for name in [name for name in TABLE if name != "full" and make_policy(name).prefill_only]:
        policy = make_policy(name, budget=12)
        whole, chunked = make_cache(model, policy), make_cache(model, policy)
        assert torch.equal(read(model, ids, whole), read(model, ids, chunked, chunk=8))
        _same_layers(chunked, whole)
        assert all(layer.tokens_per_head == 12 for layer in chunked.policy_layers()), name


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_reading_one_shared_context_decode_as_their_own_copies(arch):
    """Rows that keep every new token read the shared context's KV once per step, masked to what
    each kept (`decode.context`): the same tokens as each row decoding its own copy, every row
    alone too, and the context held once, not per row. Evicting rows keep their copies."""
    model = build_tiny(arch)
    ids = torch.randint(3, 96, (96,), generator=torch.Generator().manual_seed(6)).tolist()
    shared = SharedPrefill(model, ids)
    policies = [make_policy("full")] + [
        make_policy(name, budget=budget) for name in TABLE if name != "full" for budget in (10, 24)
    ]
    keeping = [p for p in policies if p.name == "full" or type(p).prefill_only]
    questions = [[9, 10, 11 + row % 3] for row in range(len(keeping))]
    decoder = Decoder(model, keeping[0], compile="never")
    caches = [shared.cache_for(p) for p in keeping]
    batch = generate(model, questions, 7, held=caches, shared_context=shared, decoder=decoder)
    own = Decoder(model, keeping[0], compile="never")
    copies = generate(model, questions, 7, held=[shared.cache_for(p) for p in keeping], decoder=own)
    assert batch.tokens == copies.tokens
    assert decoder.state.live_tokens().tolist() == own.state.live_tokens().tolist()
    for policy, question, tokens in list(zip(keeping, questions, batch.tokens, strict=True))[::5]:
        alone = generate(model, [question], 7, policy, compile="never", held=[shared.cache_for(policy)])
        assert alone.tokens[0] == tokens, policy.name
    attention = [layer for layer in decoder.state.layers if layer.context is not None]
    assert attention and all(layer.context.keys.shape[1] == len(ids) for layer in attention)
    assert all(layer.keys.shape[2] < len(ids) for layer in attention)  # own tokens only in the slots
    evicting = [p for p in policies if p not in keeping][:2]
    mixed = Decoder(model, evicting[0], compile="never")
    held = [shared.cache_for(p) for p in evicting]
    generate(model, [[9, 10]] * 2, 3, held=held, shared_context=shared, decoder=mixed)
    assert all(layer.context is None for layer in mixed.state.layers)
