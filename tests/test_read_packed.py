"""Prompts read packed in one forward (`decode.reading.read_packed`, the server's waiting prompts) equal
each prompt read alone: the same last logits, the same tokens kept by the policy."""

import threading

import pytest
import torch
from conftest import COMMON, build_tiny, tiny_tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

import sparsegen
import sparsegen.few_rows as few_rows
import sparsegen.serve.batching as batching
from sparsegen.decode.reading import packable, read, read_packed
from sparsegen.errors import SparsegenError
from sparsegen.kv import make_cache
from sparsegen.kv.spec import KVSpec
from sparsegen.serve.events import Done, Failed, Token
from sparsegen.serve.jobs import GenerationRequest

PROMPTS = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 17, 9, 1))]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("policy", ["full", "streaming", "h2o", "snapkv", "adakv", "tova"])
def test_prompts_read_packed_equal_each_read_alone(arch, attn, policy):
    model = build_tiny(arch, attn)
    alone = [make_cache(model, KVSpec.of(policy, budget=6)) for _ in PROMPTS]
    expected = torch.stack([read(model, ids, cache) for ids, cache in zip(PROMPTS, alone, strict=True)])
    packed = [make_cache(model, KVSpec.of(policy, budget=6)) for _ in PROMPTS]
    torch.testing.assert_close(read_packed(model, PROMPTS, packed), expected, rtol=1e-5, atol=1e-5)
    for one, other in zip(alone, packed, strict=True):
        assert one.physical_length() == other.physical_length()
        for a, b in zip(one.layers, other.layers, strict=True):
            assert torch.equal(a.positions, b.positions)  # the policy kept the same tokens
            torch.testing.assert_close(a.keys[:, :, : a.size], b.keys[:, :, : b.size], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(few_rows.float_rows_op() is None, reason="the few-row kernel could not be built here")
def test_in_bf16_under_the_server_s_products_a_prompt_read_packed_gives_its_logits_bit_for_bit(monkeypatch):
    """The server's setup (its Linear layers on the packed panels, a CPU without AMX): 300 rows read
    packed give each prompt the logits it gets read alone, to the last bit, so the server's answers
    do not depend on which prompts waited together (a GEMM past 256 rows moved them)."""
    monkeypatch.setattr(few_rows, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    few_rows.bf16_panel_rows.cache_clear()
    torch.manual_seed(0)  # the default model's widths: products long enough for a GEMM's other order to show
    widths = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9)
    config = LlamaConfig(**{**COMMON, **widths, "num_key_value_heads": 3, "max_position_embeddings": 512})
    model = LlamaForCausalLM(config).eval().to(torch.bfloat16)
    prompts = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((3, 260, 37))]
    patched = few_rows.use_gemv(model, rows_vary=True, packed=few_rows.pack_weights(model))
    try:
        alone = [read_packed(model, [ids], [make_cache(model, "full")])[0] for ids in prompts]
        together = read_packed(model, prompts, [make_cache(model, "full") for _ in prompts])
    finally:
        few_rows.restore_linears(patched)
        few_rows.bf16_panel_rows.cache_clear()
    assert all(torch.equal(one, row) for one, row in zip(alone, together, strict=True))


def test_a_held_cache_or_a_model_s_own_sliding_layers_are_refused():
    gemma = build_tiny("gemma3")
    assert not packable(make_cache(gemma, "full"))
    model = build_tiny("llama")
    held = make_cache(model, "full")
    read(model, [5, 6], held)
    assert not packable(held) and not packable(make_cache(model, KVSpec.of("kvzip", budget=4)))
    with pytest.raises(SparsegenError, match="fresh caches"):
        read_packed(model, [[7, 8]], [held])
    with pytest.raises(SparsegenError, match="one non-empty prompt per cache"):
        read_packed(model, [[7], []], [make_cache(model, "full"), make_cache(model, "full")])


def test_the_engine_reads_waiting_prompts_packed_and_answers_as_alone(monkeypatch):
    """Prompts submitted together are read in one packed forward; each answer equals its single run."""
    model, calls = build_tiny("llama"), []
    original = batching.read_packed
    monkeypatch.setattr(batching, "read_packed", lambda *a: calls.append(len(a[1])) or original(*a))
    budget = {"heavy": 3, "recent": 3}
    engine = batching.Engine(model, tiny_tokenizer(), KVSpec.of("h2o", **budget), prefill_chunk=64)
    answers: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    ended = threading.Semaphore(0)

    def collect(index: int, event) -> None:
        if isinstance(event, Token):
            answers[index].append(event.text)
        if isinstance(event, (Done, Failed)):
            assert not isinstance(event, Failed), event
            ended.release()

    try:
        for index, ids in enumerate(PROMPTS):
            engine.submit(GenerationRequest(ids, 5, engine.kv), lambda e, i=index: collect(i, e))
        for _ in PROMPTS:
            assert ended.acquire(timeout=60)
    finally:
        engine.close()
    assert calls and max(calls) >= 2  # at least two prompts shared a forward
    tokenizer = tiny_tokenizer()
    for index, ids in enumerate(PROMPTS):
        made = sparsegen.generate(model, [ids], 5, KVSpec.of("h2o", **budget), compile="never")
        assert "".join(answers[index]) == tokenizer.decode(made.tokens[0], skip_special_tokens=True)


def test_a_failed_packed_read_fails_its_requests_frees_their_kv_and_the_engine_serves_on(monkeypatch):
    model, failures = build_tiny("llama"), []

    def broken(*_args):
        failures.append(1)
        raise RuntimeError("injected failure")

    monkeypatch.setattr(batching, "read_packed", broken)
    engine = batching.Engine(model, tiny_tokenizer(), "full", prefill_chunk=64)
    events: dict[int, list] = {i: [] for i in range(4)}
    ended = threading.Semaphore(0)

    def collect(index: int, event) -> None:
        events[index].append(event)
        if isinstance(event, (Done, Failed)):
            ended.release()

    try:
        for index, ids in enumerate(PROMPTS[:3]):
            engine.submit(GenerationRequest(ids, 3, engine.kv), lambda e, i=index: collect(i, e))
        for _ in range(3):
            assert ended.acquire(timeout=60)
        assert failures and engine.held_kv_bytes() == 0
        assert all(isinstance(events[i][-1], Failed) and "injected failure" in events[i][-1].message for i in range(3))
        monkeypatch.undo()  # the reads work again: the engine answers the next request
        engine.submit(GenerationRequest(PROMPTS[1], 3, engine.kv), lambda e: collect(3, e))
        assert ended.acquire(timeout=60)
    finally:
        engine.close()
    assert isinstance(events[3][-1], Done) and events[3][-1].finish_reason in ("stop", "length")
