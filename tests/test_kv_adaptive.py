"""Head-adaptive caches (AdaKV, DuoAttention): heads share a layer's budget, and the cache holds that budget's bytes."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sparsegen.decode import Decoder, generate
from sparsegen.errors import SparsegenError
from sparsegen.eval.calibrate_heads import calibrate_heads, save_heads
from sparsegen.kv import make_cache, make_policy, policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import COMMON, build_tiny, tiny_tokenizer


def _generate(model, ids, cache, new=20):
    with policy_attention(model):
        return model.generate(ids, cache=cache, max_new_tokens=new, do_sample=False, pad_token_id=0)


def test_a_full_safeguard_keeps_each_heads_own_best_as_the_scorer_does():
    """alpha=1 guarantees every head its own top budget: the shared pool then changes nothing."""
    for arch in ("llama", "gemma3"):
        model = build_tiny(arch)
        ids = torch.randint(3, 96, (2, 60), generator=torch.Generator().manual_seed(0))
        adaptive = _generate(model, ids, make_cache(model, KVSpec.of("adakv", budget=16, alpha=1.0)))
        per_head = _generate(model, ids, make_cache(model, KVSpec.of("expected_attention", budget=16)))
        assert torch.equal(adaptive, per_head)


def test_the_fast_path_decodes_as_the_drop_in_cache():
    model = build_tiny("mistral")
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(2))
    policy = make_policy("adakv", budget=12)
    fast = generate(model, [ids[0].tolist()], 20, policy, compile="never").tokens[0]
    assert fast == _generate(model, ids, make_cache(model, policy))[0, 60:].tolist()


def test_the_cache_holds_the_budgets_bytes_not_the_largest_heads_times_the_heads():
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(3))
    budget, new = 64, 10
    cache = make_cache(model, KVSpec.of("adakv", budget=budget))
    _generate(model, ids, cache, new=new + 1)
    head_dim = config.hidden_size // config.num_attention_heads
    per_slot = 2 * head_dim * 4  # a key and a value, fp32
    budget_bytes = (budget + new) * config.num_key_value_heads * config.num_hidden_layers * per_slot
    layers = cache.policy_layers()
    allocated = sum(layer.keys.numel() + layer.values.numel() for layer in layers) * 4
    assert cache.kv_bytes() == budget_bytes
    assert budget_bytes <= allocated <= 1.1 * budget_bytes
    counts = [[len(kept) for kept in layer.kept_positions()[0]] for layer in layers]
    assert all(sum(c) == (budget + new) * config.num_key_value_heads for c in counts)
    largest = sum(max(c) for c in counts) * config.num_key_value_heads * per_slot
    assert largest > 1.1 * budget_bytes  # heads really differ: a padded layout would hold more


def _allocated(state) -> int:
    """Bytes of the storage behind every layer's key and value buffers in the fast path's slots."""
    return sum(t.untyped_storage().nbytes() for layer in state.layers for t in (layer.keys, layer.values))


def _four_heads_case():
    """A model whose layers have 4 KV heads, a 200-token prompt, AdaKV at 56 tokens a head (of
    200), 8 new tokens; the bytes of keys and values that budget holds; and the bytes a layout
    padding each head to its layer's largest head would hold, from the drop-in cache's kept sets."""
    config = LlamaConfig(**{**COMMON, "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, 96, (1, 200), generator=torch.Generator().manual_seed(3))
    kv, new = KVSpec.of("adakv", budget=56), 8
    per_slot = 2 * (config.hidden_size // config.num_attention_heads) * 4  # a key and a value, fp32
    budget_bytes = (56 + new) * config.num_key_value_heads * config.num_hidden_layers * per_slot
    cache = make_cache(model, kv)
    _generate(model, ids, cache, new=1)
    counts = [[len(kept) for kept in layer.kept_positions()[0]] for layer in cache.policy_layers()]
    padded = sum(max(c) + new for c in counts) * config.num_key_value_heads * per_slot
    return model, ids[0].tolist(), kv, new, budget_bytes, padded


def test_the_fast_path_allocates_the_budgets_bytes_not_the_largest_heads_times_the_heads():
    model, prompt, kv, new, budget_bytes, padded = _four_heads_case()
    assert padded > 1.1 * budget_bytes  # heads really differ: a padded layout would hold more
    with policy_attention(model):
        decoder = Decoder(model, kv, compile="never")
        logits = decoder.start([prompt], new)
        allocated = [_allocated(decoder.state)]
        for _ in range(new - 1):
            logits = decoder.step(logits.argmax(-1))
            allocated.append(_allocated(decoder.state))
    assert all(budget_bytes <= held <= 1.1 * budget_bytes for held in allocated)


def test_a_server_row_allocates_the_budgets_bytes():
    import threading

    from sparsegen.serve.batching import Engine
    from sparsegen.serve.events import Done, Failed
    from sparsegen.serve.jobs import GenerationRequest

    model, prompt, kv, new, budget_bytes, _ = _four_heads_case()
    allocated, steps = [], Engine._decode_step

    def measured(engine, lane) -> None:  # each step of the server's lane, its slots as allocated
        allocated.append(_allocated(lane.decoder.state))
        steps(engine, lane)

    engine = Engine(model, tiny_tokenizer(), kv)
    try:
        ended, events = threading.Event(), []
        engine._decode_step = measured.__get__(engine)
        engine.submit(
            GenerationRequest(prompt, new, kv),
            lambda e: (events.append(e), isinstance(e, (Done, Failed)) and ended.set()),
        )
        assert ended.wait(60) and isinstance(events[-1], Done), events[-1]
    finally:
        engine.close()
    assert allocated and all(budget_bytes <= held <= 1.1 * budget_bytes for held in allocated)


def test_a_handed_back_row_holds_what_the_drop_in_cache_holds():
    """The server keeps a conversation by handing its row back from the fast path's slots."""
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 50), generator=torch.Generator().manual_seed(4))
    policy = make_policy("adakv", budget=10)
    with policy_attention(model):
        decoder = Decoder(model, policy, compile="never")
        logits = decoder.start([ids[0].tolist()], 6)
        tokens = []
        for _ in range(6):
            tokens.append(int(logits.argmax(-1)))
            logits = decoder.step(torch.tensor(tokens[-1:]))
        handed = decoder.hand_back(0)
        alone = make_cache(model, policy)
        model(torch.cat([ids, torch.tensor([tokens])], 1)[:, :50], cache=alone)
        model(torch.tensor([tokens]), cache=alone)
    for mine, theirs in zip(handed.policy_layers(), alone.policy_layers(), strict=True):
        assert mine.kept_positions() == theirs.kept_positions()
        assert mine.tokens_per_head == theirs.tokens_per_head == 16


def test_duo_attention_gives_the_pool_to_the_heads_its_calibration_ranks_first(tmp_path):
    model = build_tiny("llama")  # 3 layers x 2 KV heads
    scores = calibrate_heads(model, tiny_tokenizer(), samples=2, length=96)
    assert scores.shape == (3, 2) and bool(((scores >= 0) & (scores <= 1)).all())
    save_heads(torch.tensor([[0.9, 0.1], [0.2, 0.7], [0.5, 0.6]]), tmp_path / "heads.json", "tiny")
    policy = make_policy("duo_attention", sinks=2, heavy=20, recent=4, heads=str(tmp_path / "heads.json"))
    cache = make_cache(model, policy)
    _generate(model, torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(5)), cache, new=1)
    kept = [[len(head) for head in layer.kept_positions()[0]] for layer in cache.policy_layers()]
    assert kept == [[46, 6], [6, 46], [6, 46]]  # the retrieval head: 2 + 20 * 2 + 4 of 60; the streaming one: 2 + 4


def test_calibrate_heads_equals_the_needle_share_of_eager_attention_weights():
    """Brute force: transformers' eager attention weights (output_attentions), the answer's rows,
    summed over each KV head's group, the needle's share of them, averaged over the samples."""
    import random

    from sparsegen.eval.calibrate_heads import passkey_prompt

    model, tokenizer = build_tiny("llama", attn="eager"), tiny_tokenizer()
    scores = calibrate_heads(model, tokenizer, samples=2, length=96, seed=3)
    rng, expected = random.Random(3), torch.zeros(3, 2, dtype=torch.float64)
    for _ in range(2):
        ids, needle, answer = passkey_prompt(tokenizer, 96, rng)
        with torch.no_grad():
            weights = model(torch.tensor([ids]), output_attentions=True).attentions
        for layer, probabilities in enumerate(weights):  # [1, q heads, queries, keys]
            rows = probabilities[0, :, -answer:].double().view(2, -1, answer, len(ids))  # by KV head
            expected[layer] += rows[..., needle.start : needle.stop].sum((1, 2, 3)) / rows.sum((1, 2, 3))
    torch.testing.assert_close(scores.double(), expected / 2, rtol=1e-4, atol=1e-6)


def test_duo_attention_refuses_heads_of_another_model(tmp_path):
    save_heads(torch.zeros(5, 3), tmp_path / "heads.json", "other")
    model = build_tiny("llama")
    cache = make_cache(
        model, KVSpec.of("duo_attention", sinks=2, heavy=8, recent=4, heads=str(tmp_path / "heads.json"))
    )
    with pytest.raises(SparsegenError, match="calibrated for another model"):
        _generate(model, torch.randint(3, 96, (1, 40)), cache, new=1)


def test_calibrate_heads_command_writes_the_heads_a_policy_reads(monkeypatch, capsys, tiny_folder, tmp_path):
    from tests.test_cli import run_cli

    heads = tmp_path / "heads.json"
    args = ["eval", "calibrate-heads", "--model", tiny_folder, "--samples", "1", "--length", "96", "--out", heads]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "3 layers x 2 KV heads" in out
    assert make_policy("duo_attention", budget=16, heads=str(heads)).heads == str(heads)
    code, _, err = run_cli(monkeypatch, capsys, "eval", "calibrate-heads", "--model", tiny_folder, "--length", "8")
    assert code != 0 and "--length" in err and "Traceback" not in err
