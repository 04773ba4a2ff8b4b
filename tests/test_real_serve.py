"""The server on the real default model: a streamed answer, a 100-turn conversation, lm-eval through it."""

import lm_eval
import openai
import pytest
from serving import conversation_rss, live_server

from sparsegen.eval.harness import SparsegenLM
from sparsegen.eval.tasks import task_manager
from sparsegen.kv.spec import KVSpec
from sparsegen.loading import resolve_model_path

pytestmark = pytest.mark.real


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_streamed_chat_and_a_100_turn_conversation_in_bounded_memory(real):
    with live_server(real, KVSpec.of("streaming", sinks=4, recent=252), model_id="smollm2-135m") as (url, app):
        client = _client(url)
        stream = client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20,
            temperature=0,
            stream=True,
        )
        answer = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert "Paris" in answer
        turns = [f"Tell me one fact about the number {i}." for i in range(100)]
        usages, rss = conversation_rss(client, "smollm2-135m", turns, max_tokens=8)
        assert all(u["kv_tokens_held"] <= 256 for u in usages)
        assert usages[-1]["prompt_tokens"] > 2000  # the history is far longer than the budget
        assert all(u["prompt_tokens_details"]["cached_tokens"] > 0 for u in usages[1:])
        assert max(rss[10:]) <= 1.05 * rss[10], rss
        per_conversation = 256 * 30 * 3 * 64 * 2 * 4  # tokens x layers x KV heads x head dim x (K, V) x fp32
        assert app.state.engine.stats()["conversations"] == 2  # the first question's, and the long one
        assert app.state.engine.held_kv_bytes() <= 2 * per_conversation


def test_chat_answers_carry_no_template_tokens_across_prompts_and_sampling(real):
    """The README's snippet as a user sends it (no sampling fields), and sampled variants: every
    answer stops at the end of its turn and shows no chat-template token."""
    questions = ["What is the capital of France?", "Write a haiku about rain.", "List three fruits.", "Hi!"]
    settings = [{}, {"temperature": 0.7, "seed": 1}, {"temperature": 1.0, "top_p": 0.9, "seed": 2}]
    specials = set(real[1].all_special_tokens) | {"<|im_start|>", "<|im_end|>"}
    with live_server(real, KVSpec.of("streaming", budget=512), model_id="smollm2-135m") as (url, _):
        client = _client(url)
        replies = [
            client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": q}], max_tokens=48, **extra
            )
            for q in questions
            for extra in settings
        ]
    texts = [r.choices[0].message.content for r in replies]
    assert not [t for t in texts if any(s in t for s in specials) or "\nassistant" in t or "\nuser\n" in t]
    assert any(r.choices[0].finish_reason == "stop" for r in replies)  # some answers end their turn
    assert "Paris" in texts[0]  # the default (greedy, from the generation config) answers sensibly


def test_lm_evals_completions_client_scores_through_the_server_as_in_process(real):
    with live_server(real, "full", model_id="smollm2-135m") as (url, _):
        args = (
            f"model=smollm2-135m,base_url={url}/v1/completions,tokenizer={resolve_model_path('smollm2-135m')},"
            "tokenizer_backend=huggingface,max_retries=1"
        )
        kwargs = {"tasks": ["copa"], "limit": 10, "task_manager": task_manager(), "log_samples": False}
        remote = lm_eval.simple_evaluate(model="local-completions", model_args=args, **kwargs)
    local = lm_eval.simple_evaluate(model=SparsegenLM(loaded=real), **kwargs)
    assert remote["results"]["copa"]["acc,none"] == local["results"]["copa"]["acc,none"]
