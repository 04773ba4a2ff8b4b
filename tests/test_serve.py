"""The OpenAI-compatible server, through the real `openai` client against a live server on 127.0.0.1."""

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from conftest import build_tiny, tiny_tokenizer
from serving import conversation_rss, live_server

from sparsegen.kv.footprint import kv_bytes_per_token
from sparsegen.kv.spec import KVSpec

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w4 {% else %}w5 {% endif %}{{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
)
LARGE = {"sinks": 2, "recent": 200}  # larger than any test prompt: streaming equals the dense model


def _loaded(arch: str = "llama"):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return build_tiny(arch), tokenizer


@pytest.fixture(scope="module")
def server():
    loaded = _loaded()
    with live_server(loaded, KVSpec.of("streaming", **LARGE)) as (url, app):
        yield url, app, loaded


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _generate(loaded, text: str, max_new_tokens: int) -> str:
    """transformers' own greedy generate(), the reference the server must match."""
    model, tokenizer = loaded
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def test_streamed_chat_equals_the_plain_answer_and_transformers_generate(server):
    url, _, loaded = server
    client = _client(url)
    messages = [{"role": "user", "content": "w10 w11 w12 w13"}]
    pieces, finish = [], None
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert finish == plain.choices[0].finish_reason and finish in ("stop", "length")
    assert len(pieces) > 1 and "".join(pieces) == plain.choices[0].message.content
    prompt = loaded[1].apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert plain.choices[0].message.content == _generate(loaded, prompt, 12)
    assert plain.usage.prompt_tokens == len(loaded[1](prompt, add_special_tokens=False)["input_ids"])


def test_greedy_completion_equals_transformers_generate(server):
    url, _, loaded = server
    reply = _client(url).completions.create(model="tiny", prompt="w7 w8 w9 w20 w21", max_tokens=10, temperature=0)
    assert reply.choices[0].text == _generate(loaded, "w7 w8 w9 w20 w21", 10)
    assert reply.usage.prompt_tokens == 5 and 1 <= reply.usage.completion_tokens <= 10


def test_echo_logprobs_equal_a_direct_computation(server):
    url, _, (model, tokenizer) = server
    ids = tokenizer("w30 w31 w32 w33 w34 w35", add_special_tokens=False)["input_ids"]
    reply = _client(url).completions.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1
    )
    logprobs = reply.choices[0].logprobs
    with torch.inference_mode():
        want = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == len(ids) + 1
    for position, token in enumerate(ids[1:]):
        assert logprobs.token_logprobs[position + 1] == pytest.approx(float(want[position, token]), abs=1e-4)
        assert max(logprobs.top_logprobs[position + 1].values()) == pytest.approx(float(want[position].max()), abs=1e-4)
    assert logprobs.token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=1e-4)  # the greedy next token


def test_sampling_is_reproducible_with_a_seed(server):
    url, _, _ = server
    client = _client(url)

    def ask(seed):
        return (
            client.completions.create(model="tiny", prompt="w7 w8", max_tokens=8, temperature=1.0, top_p=0.9, seed=seed)
            .choices[0]
            .text
        )

    assert ask(1) == ask(1)
    assert len({ask(seed) for seed in range(2, 6)}) > 1


def test_eight_concurrent_clients_each_get_a_complete_answer(server):
    url, _, _ = server
    answers: dict[int, list] = {}

    def client_loop(number: int) -> None:
        client = _client(url)
        answers[number] = [
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"w{10 + number} w{20 + turn}"}],
                max_tokens=6,
                temperature=0,
            )
            for turn in range(3)
        ]

    threads = [threading.Thread(target=client_loop, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert sorted(answers) == list(range(8))
    for replies in answers.values():
        for reply in replies:
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert reply.usage.completion_tokens == 6 or reply.choices[0].finish_reason == "stop"


def test_a_long_conversation_reuses_its_cache_and_stays_within_the_budget():
    with live_server(_loaded(), KVSpec.of("streaming", sinks=2, recent=30)) as (url, app):
        turns = [f"w{10 + i % 80} w{20 + i % 70} w{30 + i % 60}" for i in range(100)]
        usages, rss = conversation_rss(_client(url), "tiny", turns, max_tokens=3)
        assert all(u["kv_tokens_held"] <= 32 for u in usages)
        assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages[1:])
        assert usages[-1]["prompt_tokens"] > 600  # the history is far longer than what is held
        assert app.state.engine.stats()["conversations"] == 1
        assert max(rss[10:]) <= 1.05 * rss[10]


def test_a_client_that_disconnects_stops_its_generation(server):
    url, app, _ = server
    engine = app.state.engine
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4000, "temperature": 0, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6), strict=False) if line.startswith("data:")) >= 3
    deadline = time.monotonic() + 15
    while engine.stats()["active"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats()["active"] == 0
    metrics = httpx.get(f"{url}/metrics").text
    assert "sparsegen_active_generations 0.0" in metrics


def _error(response: httpx.Response) -> dict:
    assert response.headers["content-type"].startswith("application/json")
    return response.json()["error"]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server):
    url, _, _ = server
    chat = f"{url}/v1/chat/completions"
    user = [{"role": "user", "content": "w5"}]
    response = httpx.post(chat, content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in _error(response)["message"]
    response = httpx.post(chat, json={"model": "gpt-9", "messages": user})
    assert response.status_code == 404 and _error(response)["code"] == "model_not_found"
    response = httpx.post(chat, json={"model": "tiny", "messages": []})
    assert response.status_code == 400 and _error(response)["param"] == "messages"
    for max_tokens in (0, 10**6):
        response = httpx.post(chat, json={"model": "tiny", "messages": user, "max_tokens": max_tokens})
        assert response.status_code == 400 and _error(response)["param"] == "max_tokens"
    response = httpx.post(chat, json={"model": "tiny", "messages": user, "temperature": -1})
    assert response.status_code == 400 and _error(response)["param"] == "temperature"
    response = httpx.post(chat, json={"model": "tiny", "messages": user, "seed": 2**70})
    assert response.status_code == 400 and _error(response)["param"] == "seed"
    response = httpx.post(
        chat, content=b'{"model": "tiny", "messages": "\xff\xfe"}', headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "JSON" in _error(response)["message"]
    response = httpx.get(f"{url}/v1/nothing")
    assert response.status_code == 404 and _error(response)["message"]
    client = _client(url)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=user)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=[10**6], max_tokens=2)
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    assert client.chat.completions.create(model="tiny", messages=user, max_tokens=2).choices[0].finish_reason


def test_a_prompt_longer_than_the_full_policy_holds_is_refused():
    with live_server(_loaded(), "full") as (url, _):
        long = " ".join(f"w{5 + i % 90}" for i in range(300))  # the tiny model has 256 positions
        response = httpx.post(
            f"{url}/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": long}]}
        )
        assert response.status_code == 400 and _error(response)["code"] == "context_length_exceeded"
        ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5 w6", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_held_conversations_stay_under_the_memory_cap_and_come_back_rebuilt():
    loaded = _loaded()
    room = 16 * kv_bytes_per_token(loaded[0])  # one short request (about 9 tokens), not a held one beside it
    with live_server(loaded, KVSpec.of("streaming", sinks=2, recent=30), max_kv_bytes=room) as (url, app):
        client = _client(url)
        first = [{"role": "user", "content": "w10 w11"}]
        reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=3, temperature=0)
        for other in ("w20 w21", "w30 w31"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": other}], max_tokens=3)
        assert app.state.engine.stats()["conversations"] == 1
        follow_up = [
            *first,
            {"role": "assistant", "content": reply.choices[0].message.content},
            {"role": "user", "content": "w12"},
        ]
        again = client.chat.completions.create(model="tiny", messages=follow_up, max_tokens=3, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # dropped, so rebuilt from the history
        assert again.choices[0].finish_reason in ("stop", "length")


def test_a_failure_inside_one_request_is_a_500_and_the_next_request_is_served(server, monkeypatch):
    from sparsegen.serve import batching

    url, _, _ = server
    original = batching.read_packed  # the engine's read of a lone fresh prompt
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    monkeypatch.setattr(batching, "read_packed", flaky)
    body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 2}
    response = httpx.post(f"{url}/v1/completions", json=body)
    assert response.status_code == 500 and "injected failure" in _error(response)["message"]
    assert httpx.post(f"{url}/v1/completions", json=body).status_code == 200


def test_models_health_and_metrics(server):
    url, _, _ = server
    assert [m.id for m in _client(url).models.list()] == ["tiny"]
    health = httpx.get(f"{url}/health").json()
    assert health["policy"] == "streaming" and health["active"] == 0
    metrics = httpx.get(f"{url}/metrics").text
    for name in (
        "sparsegen_requests_total",
        "sparsegen_prompt_tokens_total",
        "sparsegen_completion_tokens_total",
        "sparsegen_time_to_first_token_seconds_count",
        "sparsegen_kv_bytes_held",
        "process_resident_memory_bytes",
    ):
        assert name in metrics
    served = json.loads(json.dumps(health))
    assert served["model"] == "tiny"


def _ask_together(url: str, prompts: list[str], extras: list[dict | None], max_tokens: int) -> dict[int, str]:
    """Every prompt as a greedy completion from its own thread at once (its extension fields in
    `extras`); each one's text by index."""
    results: dict[int, str] = {}

    def ask(index: int) -> None:
        reply = _client(url).completions.create(
            model="tiny", prompt=prompts[index], max_tokens=max_tokens, temperature=0, extra_body=extras[index]
        )
        results[index] = reply.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def test_concurrent_greedy_requests_of_mixed_lengths_and_policies_each_get_their_single_request_output():
    from sparsegen.decode import generate

    loaded = _loaded()
    model, tokenizer = loaded
    prompts = [" ".join(f"w{5 + (i * 7 + j) % 90}" for j in range(n)) for i, n in enumerate((3, 11, 40, 7, 25, 60))]
    policies = [
        None,
        {"kv_policy": "h2o", "kv_budget": 0.5},
        {"kv_policy": "full"},
        {"kv_policy": "h2o", "kv_budget": 12},
        {"kv_policy": "kvzip", "kv_budget": 4},  # re-reads its first prompt chunk to score it
    ]
    with live_server(loaded, KVSpec.of("streaming", sinks=2, recent=16), prefill_chunk=8) as (url, app):
        extras = [policies[index % len(policies)] for index in range(len(prompts))]
        results = _ask_together(url, prompts, extras, max_tokens=14)
        assert app.state.engine.stats()["active"] == 0
    for index, prompt in enumerate(prompts):
        extra = policies[index % len(policies)] or {"kv_policy": "streaming"}
        budget = {"budget": extra["kv_budget"]} if "kv_budget" in extra else {}
        if extra["kv_policy"] == "streaming":
            budget = {"sinks": 2, "recent": 16}
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        alone = generate(model, [ids], 14, KVSpec.of(extra["kv_policy"], **budget), compile="never", prefill_chunk=8)
        assert results[index] == tokenizer.decode(alone.tokens[0], skip_special_tokens=True), index


def test_a_row_joins_and_another_leaves_while_a_long_one_decodes():
    loaded = _loaded()
    with live_server(loaded, KVSpec.of("streaming", **LARGE)) as (url, app):
        engine = app.state.engine
        body = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 200, "temperature": 0, "stream": True}
        short = {"model": "tiny", "prompt": "w9 w10 w11", "max_tokens": 3, "temperature": 0}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert sum(1 for line, _ in zip(lines, range(4), strict=False) if line.startswith("data:")) >= 2
            reply = httpx.post(f"{url}/v1/completions", json=short, timeout=60).json()  # joins, then leaves
            assert reply["usage"]["completion_tokens"] >= 1
            assert engine.stats()["active"] == 1  # the long row still decodes
        deadline = time.monotonic() + 15
        while engine.stats()["active"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.stats()["active"] == 0 and not any(lane.jobs for lane in engine.lanes.values())


def test_requests_wait_for_kv_memory_and_past_the_queue_get_429():
    loaded = _loaded()
    room = 40 * kv_bytes_per_token(loaded[0])  # one request of 33 slots at a time
    with live_server(loaded, KVSpec.of("streaming", sinks=2, recent=30), max_kv_bytes=room, max_queue=1) as (url, app):
        long = {"model": "tiny", "prompt": "w5 w6", "max_tokens": 4000, "temperature": 0, "stream": True}
        short = {"model": "tiny", "prompt": "w7 w8", "max_tokens": 40}  # needs all 33 slots too
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=long) as response:
            lines = response.iter_lines()  # kept open: closing the iterator would disconnect
            assert next(line for line in lines if line.startswith("data:"))
            waiting = threading.Thread(target=lambda: httpx.post(f"{url}/v1/completions", json=short, timeout=60))
            waiting.start()
            deadline = time.monotonic() + 10
            while app.state.engine.stats()["queued"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            refused = httpx.post(f"{url}/v1/completions", json=short)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert _error(refused)["code"] == "rate_limit_exceeded"
        waiting.join(timeout=60)
        too_big = httpx.post(f"{url}/v1/completions", json={**short, "kv_policy": "full", "max_tokens": 60})
        assert too_big.status_code == 400 and "--max-kv-mb" in _error(too_big)["message"]
        bad = httpx.post(f"{url}/v1/completions", json={**short, "kv_policy": "nope"})
        assert bad.status_code == 400 and _error(bad)["param"] == "kv_policy"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'sparsegen_admitted_total{policy="streaming"}' in metrics and "sparsegen_requests_queued 0.0" in metrics


def test_sampling_defaults_come_from_the_generation_config():
    from sparsegen.serve.jobs import sampling_defaults

    model = build_tiny("llama")
    assert sampling_defaults(model) == {"temperature": 0.0, "top_p": 1.0}
    model.generation_config.do_sample, model.generation_config.temperature = True, 0.3
    model.generation_config.top_p = 0.9
    assert sampling_defaults(model) == {"temperature": 0.3, "top_p": 0.9}


def test_requests_in_different_kv_bits_batch_apart_and_each_equals_its_single_run():
    from sparsegen.decode import generate

    loaded = _loaded()
    model, tokenizer = loaded
    prompts = [" ".join(f"w{5 + (i * 11 + j) % 90}" for j in range(n)) for i, n in enumerate((9, 30, 17, 26))]
    bits = [4, 8, None, 3]
    with live_server(loaded, KVSpec.of("h2o", budget=12, kv_bits=4), prefill_chunk=8) as (url, app):
        extras = [{"kv_bits": b} if b != 4 else {} for b in bits]  # omitted: the server's 4; null: none
        results = _ask_together(url, prompts, extras, max_tokens=12)
        bad = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "w5", "kv_bits": 5})
        assert bad.status_code == 400 and "kv_bits" in str(_error(bad)["param"]) + _error(bad)["message"]
        assert app.state.engine.stats()["active"] == 0
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        alone = generate(
            model, [ids], 12, KVSpec.of("h2o", kv_bits=bits[index], budget=12), compile="never", prefill_chunk=8
        )
        assert results[index] == tokenizer.decode(alone.tokens[0], skip_special_tokens=True), index
