"""Rows of several policies decode in one step (`decode.groups`), each as its single run."""

import torch

from sparsegen.decode import Decoder, generate
from sparsegen.decode.groups import RowGroups
from sparsegen.kv import make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.shared import SharedPrefill
from tests.conftest import build_tiny

POLICIES = [("full", None), ("h2o", 16), ("streaming", 16), ("snapkv", 16), ("window", 20), ("tova", 20)]
POLICIES += [("streaming_h2o", 16), ("h2o", 28), ("kvzip", 24)]


def _batch(model, shared, steps: int):
    policies = [make_policy(name, budget=budget) if budget else make_policy(name) for name, budget in POLICIES]
    questions = [[9, 10, 11 + row % 4] for row in range(len(policies))]
    decoder = Decoder(model, policies[0], compile="never")
    held = [shared.cache_for(policy) for policy in policies]
    made = generate(model, questions, steps, held=held, shared_context=shared, decoder=decoder, eos_token_id=[])
    return policies, questions, decoder, made


def test_rows_of_several_policies_decode_in_one_step_as_their_single_runs():
    model = build_tiny("qwen2")
    ids = torch.randint(3, 96, (64,), generator=torch.Generator().manual_seed(9)).tolist()
    shared = SharedPrefill(model, ids)
    policies, questions, decoder, made = _batch(model, shared, 10)
    layer = decoder.state.layers[0]
    assert isinstance(layer, RowGroups) and len(layer.groups) == 6  # the rows that keep every token, 5 evicting classes
    for policy, question, tokens in zip(policies, questions, made.tokens, strict=True):
        cache = shared.cache_for(policy)
        alone = generate(model, [question], 10, policy, compile="never", held=[cache], eos_token_id=[])
        assert alone.tokens[0] == tokens, policy.name
    held = decoder.state.live_tokens()
    assert held[0] == len(ids) + 3 + 9 and held[1] == 16  # the full cache keeps all, h2o its budget


def test_rows_leaving_a_mixed_batch_leave_the_others_as_they_were():
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    shared = SharedPrefill(model, ids)
    _, _, whole, made = _batch(model, shared, 6)
    _, _, part, _ = _batch(model, shared, 6)
    staying = [0, 2, 3, 5, 6, 8]  # every h2o row (1, 7) and the window row (4) leave: their groups go
    before = whole.state.live_tokens()
    part.leave([1, 4, 7])
    assert part.state.live_tokens().tolist() == before[staying].tolist()
    assert len(part.state.layers[0].groups) == 4
    tokens = torch.tensor([row[-1] for row in made.tokens])
    with policy_attention(model):
        after = part.step(tokens[staying]), whole.step(tokens)[staying]
    torch.testing.assert_close(*after, rtol=1e-4, atol=1e-4)
