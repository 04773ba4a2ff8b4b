"""Compressing every N steps (`Policy.compress_every`, kvpress's decoding protocol): the fast path,
its batches, its compiled step, rows over a shared context and the server all hold and evict what
the drop-in cache under transformers' generate() does (itself checked against brute force in
tests/test_kv_policies.py)."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.decode.shared import SharedPrefill
from sparsegen.kv import PolicyLayer, make_cache, make_policy
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny, tiny_tokenizer
from tests.kv_reference import TABLE, generate_drop_in

DECODING = [name for name, row in TABLE.items() if row.bounded]
EVERY = 3


def _prompt(length: int, seed: int = 1) -> list[int]:
    return torch.randint(3, 96, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("policy", DECODING)
def test_the_fast_path_equals_the_drop_in_cache_and_holds_what_it_holds(arch, policy):
    model = build_tiny(arch)
    model.generation_config.eos_token_id = None  # both write all 24 tokens: through several compressions
    parts, budget = TABLE[policy].small, sum(TABLE[policy].small.values())
    for position in ("original", "rolling"):
        spec = KVSpec.of(policy, position=position, compress_every=EVERY, **parts)
        cache = make_cache(model, spec)
        reference = generate_drop_in(model, torch.tensor([_prompt(21)]), cache, 24)
        written = len(reference) - 1  # after the prompt's compression to the budget: 7 rounds, 2 let in since
        held = {layer.size for layer in cache.layers if isinstance(layer, PolicyLayer)}  # (not Gemma's window layers)
        assert written == 23 and held == {budget + written % EVERY}, (policy, position)
        decoder = Decoder(model, spec, compile="never")
        out = generate(model, [_prompt(21)], 24, spec, compile="never", decoder=decoder)
        assert out.tokens[0] == reference, (policy, position)
        layers = [layer for layer in decoder.state.layers if layer.policy.compress_every == EVERY]
        assert {int(count) for layer in layers for count in (layer.positions >= 0).sum(-1).flatten()} == held
        assert {layer.keys.shape[2] for layer in layers} == {budget + EVERY}  # the slots: the most it ever holds


def test_rows_of_different_budgets_compress_on_their_own_steps_and_decode_as_alone():
    model = build_tiny("qwen2")
    prompts = [_prompt(n, seed=n) for n in (12, 30, 20)]
    spec = KVSpec.of("h2o", budget=0.5, compress_every=4)  # a share: each row its own budget
    decoder = Decoder(model, spec, compile="never")
    with policy_attention(model):
        tokens = [decoder.start(prompts, 13).argmax(-1)]
        held = []
        for _ in range(12):
            tokens.append(decoder.step(tokens[-1]).argmax(-1))
            held.append(decoder.state.live_tokens().tolist())
    for row, prompt in enumerate(prompts):
        budget, counts = spec.policy.sizes(len(prompt)).budget, [step[row] for step in held]
        assert min(counts) == budget and max(counts) == budget + 3, (row, counts)
        alone = generate(model, [prompt], 13, spec, compile="never", eos_token_id=[])
        assert [int(step[row]) for step in tokens] == alone.tokens[0], row


def test_the_compiled_step_compresses_in_one_graph_and_equals_eager():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = build_tiny("llama", layers=2)
    spec = KVSpec.of("h2o", budget=8, compress_every=4)
    runs = {}
    for mode in ("never", "always"):
        graphs = counters["stats"]["unique_graphs"]
        decoder = Decoder(model, spec, compile=mode, notify=lambda _: None)
        with policy_attention(model):
            logits = [decoder.start([_prompt(13)], 16)]
            for _ in range(10):  # through two compressions and the steps between them
                logits.append(decoder.step(logits[-1].argmax(-1)))
        runs[mode] = torch.cat(logits)
        if mode == "always":
            assert counters["stats"]["unique_graphs"] - graphs == 1
        decoder.release()
    torch.testing.assert_close(runs["always"], runs["never"], atol=1e-4, rtol=1e-4)


def test_rows_reading_a_shared_context_compress_as_their_own_copies():
    model = build_tiny("llama")
    shared = SharedPrefill(model, _prompt(96, seed=7))
    for name in ("h2o", "tova", "streaming"):
        policies = [make_policy(name, budget=budget, compress_every=EVERY) for budget in (10, 24, 60)]
        questions = [[9, 10, 11 + row] for row in range(len(policies))]
        decoders = [Decoder(model, policies[0], compile="never") for _ in range(2)]
        mine, theirs = (
            generate(model, questions, 9, held=[shared.cache_for(p) for p in policies], decoder=decoder, **options)
            for decoder, options in zip(decoders, ({"shared_context": shared}, {}), strict=True)
        )
        assert any(layer.context is not None for layer in decoders[0].state.layers), name
        assert mine.tokens == theirs.tokens, name
        assert decoders[0].state.live_tokens().tolist() == decoders[1].state.live_tokens().tolist(), name


def test_a_server_started_compressing_every_few_steps_answers_as_generate_does():
    import openai

    from tests.serving import live_server

    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    spec = KVSpec.of("h2o", budget=12, compress_every=4)
    assert spec.asked(None, 16, None).policy.compress_every == 4  # a request naming only a budget keeps it
    assert spec.asked("tova", 16, None).policy.compress_every == 1  # another policy: its own defaults
    prompt = " ".join(f"w{5 + i * 7 % 90}" for i in range(30))
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    with live_server((model, tokenizer), spec) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        answers = [
            client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body=extra)
            for extra in ({}, {"kv_budget": 16})
        ]
    model.generation_config.eos_token_id = None
    for answer, budget in zip(answers, (12, 16), strict=True):
        cache = make_cache(model, KVSpec.of("h2o", budget=budget, compress_every=4))
        reference = generate_drop_in(model, torch.tensor([ids]), cache, 20)
        reference = (
            reference[: reference.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in reference else reference
        )
        assert answer.choices[0].text == tokenizer.decode(reference, skip_special_tokens=True), budget


def test_bad_settings_are_one_line_errors(monkeypatch, capsys, tiny_folder):
    from tests.test_cli import run_cli

    capsys.readouterr()  # (what the fixture wrote saving the model)
    for extra, message in (
        (["--policy", "h2o", "--budget", "8", "--compress-every", "0"], "compress_every must be an int >= 1"),
        (["--policy", "snapkv", "--budget", "8", "--compress-every", "4"], "does not evict while decoding"),
    ):
        code, _, err = run_cli(monkeypatch, capsys, "generate", "w5 w6", "--model", tiny_folder, *extra)
        assert code != 0 and message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
