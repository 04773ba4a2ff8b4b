"""One prefill, many policies: a replayed cache equals the cache a policy makes reading alone."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.decode.reading import read
from sparsegen.decode.shared import SharedPrefill
from sparsegen.kv import PolicyLayer, make_cache, make_policy
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
        held = [layer.tokens_per_head for layer in chunked.policy_layers()]  # kvzip: one pool over the layers
        assert sum(held) == 12 * len(held) and (name == "kvzip" or set(held) == {12}), (name, held)


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_reading_one_shared_context_decode_as_their_own_copies(arch):
    """Rows that keep every new token read the shared context's KV once per step, masked to what
    each kept (`decode.context`): the same tokens as each row decoding its own copy, every row
    alone too, and the context held once, not per row."""
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


def _held_positions(state) -> list:
    """Every row's held positions per layer and KV head, from the slots and the shared context."""
    held = []
    for layer in state.layers:
        own = [[sorted(p for p in head.tolist() if p >= 0) for head in row] for row in layer.positions]
        if layer.context is not None:
            for row, live in zip(own, layer.context.live, strict=True):
                for head, marks in zip(row, live, strict=True):
                    head[:0] = marks.nonzero().flatten().tolist()
        held.append(own)
    return held


@pytest.mark.parametrize("arch", ARCHS)
def test_evicting_rows_reading_a_shared_context_evict_as_their_own_copies(arch):
    """Rows evicting while decoding at original positions (or at rolling positions keeping sinks
    and the newest run) read the shared context too, and drop context tokens by mask: the same
    tokens and the same held positions, layer by layer and head by head, as the rows decoding
    their own copies; other rolling positions keep their copies."""
    model = build_tiny(arch)
    ids = torch.randint(3, 96, (96,), generator=torch.Generator().manual_seed(7)).tolist()
    shared = SharedPrefill(model, ids)
    evicting = [name for name in TABLE if name != "full" and not make_policy(name).prefill_only]
    assert {"h2o", "tova", "window", "streaming"} <= set(evicting)
    for name in evicting:
        policies = [make_policy(name, budget=budget) for budget in (10, 24, 60)]
        questions = [[9, 10, 11 + row] for row in range(len(policies))]
        decoders = [Decoder(model, policies[0], compile="never") for _ in range(2)]
        mine, theirs = (
            generate(model, questions, 9, held=[shared.cache_for(p) for p in policies], decoder=decoder, **options)
            for decoder, options in zip(decoders, ({"shared_context": shared}, {}), strict=True)
        )
        assert mine.tokens == theirs.tokens, name
        assert _held_positions(decoders[0].state) == _held_positions(decoders[1].state), name
        assert decoders[0].state.live_tokens().tolist() == decoders[1].state.live_tokens().tolist(), name
        reads = [layer.context is not None for layer in decoders[0].state.layers if layer.evicting]
        policy = make_policy(name)
        assert any(reads) == (policy.default_position == "original" or policy.contiguous), name


def test_rows_of_every_policy_reading_one_shared_context_decode_as_each_alone():
    """One batch of rows of different policies over one shared context (the RULER job's batch):
    each evicts by its own policy and budget, and decodes the tokens it decodes alone."""
    model = build_tiny("qwen2")
    ids = torch.randint(3, 96, (80,), generator=torch.Generator().manual_seed(9)).tolist()
    shared = SharedPrefill(model, ids)
    names = [name for name in TABLE if make_policy(name).default_position == "original" or make_policy(name).contiguous]
    policies = [make_policy(n) if n == "full" else make_policy(n, budget=b) for n in names for b in (12, 30)]
    questions = [[9, 10, 11 + row % 4] for row in range(len(policies))]
    decoder = Decoder(model, policies[0], compile="never")
    held = [shared.cache_for(p) for p in policies]
    batch = generate(model, questions, 8, held=held, shared_context=shared, decoder=decoder)
    assert all(layer.context is not None for layer in decoder.state.layers)
    assert {type(rule) for rule in decoder.state.layers[0].context.rules} > {type(None)}
    for policy, question, tokens in zip(policies, questions, batch.tokens, strict=True):
        alone = generate(model, [question], 8, policy, compile="never", held=[shared.cache_for(policy)])
        assert alone.tokens[0] == tokens, policy.describe()
