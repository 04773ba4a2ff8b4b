"""A cancel reaches a prompt read in one forward (a policy that compresses the prompt once) within
one decoder layer: the read stops there, the request ends unanswered and frees its KV."""

import threading
import time

import pytest
import torch
from conftest import build_tiny, tiny_tokenizer

from sparsegen.decode.reading import Abandoned, read
from sparsegen.kv import make_cache, make_policy
from sparsegen.kv.spec import KVSpec
from sparsegen.models import decoder_layers
from sparsegen.serve.batching import Engine
from sparsegen.serve.events import Done, Failed
from sparsegen.serve.jobs import GenerationRequest

IDS = list(range(5, 65))


def _count_layer_calls(model) -> tuple[list[int], list]:
    """The indices of the decoder layers that ran to their end, in order, and the hooks that count them."""
    calls: list[int] = []
    layers = decoder_layers(model)
    hooks = [layer.register_forward_hook(lambda _m, _a, _o, i=i: calls.append(i)) for i, layer in enumerate(layers)]
    return calls, hooks


@pytest.mark.parametrize("policy", ["snapkv", "kvzip", "streaming"])
def test_a_read_stops_before_the_layer_after_stop_says_so_and_leaves_no_hook(policy):
    model = build_tiny("llama")
    cache = make_cache(model, make_policy(policy, budget=16))
    calls, hooks = _count_layer_calls(model)
    hooks_before = sum(len(m._forward_pre_hooks) for m in model.modules())
    with pytest.raises(Abandoned):
        read(model, IDS, cache, stop=lambda: len(calls) >= 1)
    assert calls == [0]  # the second layer never ran
    assert sum(len(m._forward_pre_hooks) for m in model.modules()) == hooks_before
    for hook in hooks:
        hook.remove()


def test_a_stop_that_never_fires_reads_as_without_it():
    model = build_tiny("llama")
    policy = make_policy("snapkv", budget=16)
    logits = read(model, IDS, make_cache(model, policy))
    assert torch.equal(read(model, IDS, make_cache(model, policy), stop=lambda: False), logits)


def test_the_engine_drops_a_request_cancelled_while_its_prompt_is_read_whole():
    model = build_tiny("llama")
    engine = Engine(model, tiny_tokenizer(), KVSpec.of("snapkv", budget=16))
    try:
        events: list = []
        ended = threading.Event()
        jobs, submitted = [], threading.Event()

        def leave(*_) -> None:  # the client goes away while the second layer reads the prompt
            submitted.wait(10)
            jobs[0].cancelled.set()

        calls, hooks = _count_layer_calls(model)
        hooks.append(decoder_layers(model)[1].register_forward_hook(leave))
        emit = lambda event: (events.append(event), isinstance(event, (Done, Failed)) and ended.set())  # noqa: E731
        jobs.append(engine.submit(GenerationRequest(IDS, 4, engine.kv), emit))
        submitted.set()
        deadline = time.monotonic() + 20
        while not (calls and engine.stats()["active"] == 0) and time.monotonic() < deadline:
            time.sleep(0.02)
        for hook in hooks:
            hook.remove()
        assert calls == [0, 1]  # left before the third layer
        assert engine.stats()["active"] == 0 and not engine.prefilling and not engine.lanes
        assert not any(isinstance(event, Done) for event in events)
    finally:
        engine.close()
