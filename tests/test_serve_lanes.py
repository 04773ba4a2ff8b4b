"""Lanes: a compiled decoder takes a lane's place while the rows already in it finish there."""

import torch
from conftest import build_tiny

from sparsegen.decode import Decoder, generate
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import make_policy
from sparsegen.serve.jobs import Job
from sparsegen.serve.lanes import DRAINING, Lanes, lane_key


def test_rows_of_a_replaced_lane_finish_there_and_new_rows_join_the_adopted_one():
    model = build_tiny("llama")
    policy = make_policy("h2o", budget=12)
    prompts = [[5, 9, 14, 3, 22, 7, 31, 2, 8], [11, 4, 19, 6, 27, 13, 2]]
    steps = 14
    made: list[Decoder] = []

    def make_decoder(p, bits):
        made.append(Decoder(model, p, compile="never", kv_bits=bits, rows_vary=True))
        return made[-1]

    lanes = Lanes(make_decoder)
    with policy_attention(model), torch.inference_mode():
        first = lanes.for_rows(policy, None)
        first.jobs = [Job(prompt, steps, print) for prompt in prompts]
        caches, logits = first.decoder.prefill(prompts)
        first.decoder.start_from(caches, steps)
        tokens, written = logits.argmax(-1), [[] for _ in prompts]
        for step in range(steps):
            if step == 5:  # the replacement arrives mid-answer
                lanes.adopt(Decoder(model, policy, compile="never", rows_vary=True), policy, None)
                assert lanes.for_rows(policy, None) is not first and len(made) == 1
                assert lanes[(*lane_key(policy, None), DRAINING)] is first
            for row, token in enumerate(tokens.tolist()):
                written[row].append(token)
            tokens = first.decoder.step(tokens).argmax(-1)
        lanes.retire_drained()
        assert (*lane_key(policy, None), DRAINING) in lanes  # rows still in it: kept
        first.decoder.leave([0, 1])
        first.jobs = []
        lanes.retire_drained()
    assert list(lanes) == [lane_key(policy, None)]
    for prompt, tokens_written in zip(prompts, written, strict=True):
        alone = generate(model, [prompt], steps, policy="h2o", compile="never", budget=12)
        assert tokens_written == alone.tokens[0][:steps]


def test_rows_share_a_lane_only_when_everything_but_their_heavy_and_recent_counts_agree():
    base = make_policy("h2o", budget=12)
    assert lane_key(base, None) == lane_key(make_policy("h2o", budget=40), None)
    assert lane_key(base, None) != lane_key(base, 4)
    streaming = make_policy("streaming", budget=12)
    assert lane_key(streaming, None) != lane_key(make_policy("streaming", budget=12, sinks=8), None)
    assert lane_key(base, None) != lane_key(make_policy("streaming", budget=12), None)
