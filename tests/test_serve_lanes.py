"""Lanes: a compiled decoder takes a lane's place while the rows already in it finish there."""

import torch
from conftest import build_tiny

from sparsegen.decode import Decoder, generate
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule
from sparsegen.serve.jobs import GenerationRequest, Job
from sparsegen.serve.lanes import DRAINING, Lanes


def test_rows_of_a_replaced_lane_finish_there_and_new_rows_join_the_adopted_one():
    model = build_tiny("llama")
    kv = KVSpec.of("h2o", budget=12)
    prompts = [[5, 9, 14, 3, 22, 7, 31, 2, 8], [11, 4, 19, 6, 27, 13, 2]]
    steps = 14
    made: list[Decoder] = []

    def make_decoder(spec):
        made.append(Decoder(model, spec, compile="never", rows_vary=True))
        return made[-1]

    lanes = Lanes(make_decoder)
    with policy_attention(model), torch.inference_mode():
        first = lanes.for_rows(kv)
        first.jobs = [Job(GenerationRequest(prompt, steps, kv), print, StopRule(steps), 0) for prompt in prompts]
        caches, logits = first.decoder.prefill(prompts)
        first.decoder.start_from(caches, steps)
        tokens, written = logits.argmax(-1), [[] for _ in prompts]
        for step in range(steps):
            if step == 5:  # the replacement arrives mid-answer
                lanes.adopt(Decoder(model, kv, compile="never", rows_vary=True), kv)
                assert lanes.for_rows(kv) is not first and len(made) == 1
                assert lanes[(*kv.step_key(), DRAINING)] is first
            for row, token in enumerate(tokens.tolist()):
                written[row].append(token)
            tokens = first.decoder.step(tokens).argmax(-1)
        lanes.retire_drained()
        assert (*kv.step_key(), DRAINING) in lanes  # rows still in it: kept
        first.decoder.leave([0, 1])
        first.jobs = []
        lanes.retire_drained()
    assert list(lanes) == [kv.step_key()]
    for prompt, tokens_written in zip(prompts, written, strict=True):
        alone = generate(model, [prompt], steps, kv, compile="never")
        assert tokens_written == alone.tokens[0][:steps]


def test_rows_share_a_lane_only_when_everything_but_their_heavy_and_recent_counts_agree():
    base = KVSpec.of("h2o", budget=12)
    assert base.shares_step_with(KVSpec.of("h2o", budget=40))
    assert not base.shares_step_with(KVSpec.of("h2o", budget=12, kv_bits=4))
    assert not KVSpec.of("h2o", kv_bits=4).shares_step_with(KVSpec.of("h2o", kv_bits=4, kv_rotated=False))
    streaming = KVSpec.of("streaming", budget=12)
    assert not streaming.shares_step_with(KVSpec.of("streaming", budget=12, sinks=8))
    assert not base.shares_step_with(KVSpec.of("streaming", budget=12))
