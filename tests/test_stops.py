"""The one stop rule: in the stop rule itself, in `generate()`, and in a streaming chat's answers."""

import torch
from tokenizers import AddedToken

from sparsegen.decode import generate
from sparsegen.decode.chat import StreamingChat
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule, Verdict, stop_tokens, template_tokens
from tests.conftest import build_tiny, tiny_tokenizer

LARGE = {"sinks": 2, "recent": 200}  # larger than any test conversation: nothing is evicted
QUESTIONS = ["w10 w11 w12 w13", "w20 w21 w22", "w30 w31 w32 w33 w34"]


def _words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def test_a_stop_string_across_tokens_is_held_back_then_cut():
    rule = StopRule(10, strings=("w7 w8",), decode=_words)
    assert rule.judge([5, 6]).text == "w5 w6"
    held = rule.judge([5, 6, 7])  # "w7" may begin the stop string: not shown yet
    assert held.reason is None and held.text == "w5 w6 "
    done = rule.judge([5, 6, 7, 8, 9])
    assert done.reason == "stop" and done.text == "w5 w6 "
    assert rule.judge([5, 6, 7, 9]).text == "w5 w6 w7 w9"  # it did not: all of it shows


def test_a_stop_token_ends_the_row_and_shows_nothing():
    rule = StopRule(10, token_ids=frozenset({1}), decode=_words)
    assert rule.judge([5, 6, 1]) == Verdict("stop", "w5 w6")
    assert StopRule(10, token_ids=frozenset({1})).judge([5, 1]).reason == "stop"  # no text without `decode`


def test_max_tokens_ends_the_row_with_all_its_text():
    rule = StopRule(3, strings=("w7 w8",), decode=_words)
    assert rule.judge([5, 6]).reason is None
    verdict = rule.judge([5, 6, 7])
    assert verdict.reason == "length" and verdict.text == "w5 w6 w7"


def test_an_undecoded_character_is_held_back():
    rule = StopRule(10, decode=lambda tokens: "ab\ufffd"[: len(tokens)])
    assert rule.judge([1, 2, 3]).text == "ab"


def _ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _turn_token_tokenizer(model, turn_index: int = 3):
    """A tokenizer whose chat template ends an assistant turn with a special token: the one the
    model makes on its own at `turn_index` of its first answer, so answers stop there. Special
    words match as whole words only, so any answer reads back as the same tokens (w30 stays w30)."""
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"unk_token": AddedToken("w3", single_word=True)})
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} "
        "{% else %}w5 {{ m['content'] }} TURN {% endif %}{% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
    )
    prompt = _ids(tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    free = generate(model, [prompt], 12, compile="never", eos_token_id=[]).tokens[0]
    turn = free[turn_index]
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(f"w{turn}", single_word=True)]})
    tokenizer.chat_template = tokenizer.chat_template.replace("TURN", f"w{turn}")
    assert template_tokens(tokenizer) == {turn}
    return tokenizer, prompt, free


def test_generate_with_a_tokenizer_stops_at_the_template_turn_token():
    model = build_tiny("llama")
    tokenizer, prompt, free = _turn_token_tokenizer(model)
    stops = stop_tokens(model, tokenizer)
    end = next(i for i, token in enumerate(free) if token in stops)
    assert free[end] in template_tokens(tokenizer)
    assert generate(model, [prompt], 12, compile="never", tokenizer=tokenizer).tokens[0] == free[: end + 1]
    assert generate(model, [prompt], 12, compile="never", tokenizer=tokenizer, eos_token_id=[]).tokens[0] == free


def _reference_answer(model, tokenizer, messages: list[dict], max_new_tokens: int) -> str:
    """transformers' greedy generate() on the whole rendered conversation, dense cache."""
    ids = torch.tensor([_ids(tokenizer, messages)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=sorted(stop_tokens(model, tokenizer)),
        pad_token_id=0,
    )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_chat_answers_equal_transformers_generate_on_the_conversation():
    model = build_tiny("llama")
    tokenizer, _, _ = _turn_token_tokenizer(model)
    chat = StreamingChat(model, tokenizer, KVSpec.of("streaming", **LARGE), max_new_tokens=8)
    messages, lengths = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        expected = _reference_answer(model, tokenizer, messages, 8)
        pieces = list(chat.ask(question))
        assert "".join(pieces) == expected == chat.messages[-1]["content"]
        messages.append({"role": "assistant", "content": expected})
        lengths.append(len(expected.split()))
    assert lengths[0] == 3 and max(lengths) == 8  # a turn that stopped at the turn token, one that ran out
