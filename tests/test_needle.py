"""Needle retrieval: the prompt is built as stated, and the question is asked over the compressed cache."""

import torch
from conftest import build_tiny, tiny_tokenizer

from sparsegen.eval.needle import NEEDLE, build_prompt, needle_job, retrieve
from sparsegen.kv import make_cache
from sparsegen.kv.spec import KVSpec

FILLER = " ".join(f"w{10 + i % 80}" for i in range(400))


def test_the_needle_sits_at_its_depth():
    tokenizer = tiny_tokenizer()
    filler = torch.tensor(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    needle = tokenizer(NEEDLE.format(key="w7"), add_special_tokens=False)["input_ids"]
    for depth, where in ((0.0, 0), (0.5, (60 - len(needle)) // 2), (1.0, 60 - len(needle))):
        context, question = build_prompt(tokenizer, filler, 60, depth, "w7")
        assert len(context) == 60 and context[where : where + len(needle)] == needle
        assert question and question[-1] == tokenizer("is", add_special_tokens=False)["input_ids"][0]


def test_full_cache_answers_as_plain_greedy_decoding_and_a_window_forgets_the_needle():
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    filler = torch.tensor(tokenizer(FILLER, add_special_tokens=False)["input_ids"])
    context, question = build_prompt(tokenizer, filler, 80, 0.1, "w7")
    answer = retrieve(model, tokenizer, context, question, make_cache(model, "full"), chunk=None, answer_tokens=5)
    ids = torch.tensor([context + question])
    greedy = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    assert answer == tokenizer.decode(greedy, skip_special_tokens=True)
    window = make_cache(model, KVSpec.of("window", recent=20))
    retrieve(model, tokenizer, context, question, window, chunk=16, answer_tokens=2)
    held = window.policy_layers()[0].held_positions()[0, 0].tolist()
    needle = len(tokenizer(NEEDLE.format(key="w7"), add_special_tokens=False)["input_ids"])
    needle_end = round(0.1 * (80 - needle)) + needle
    assert len(held) == 20 and min(held) > needle_end  # the newest tokens only: the needle is gone


def test_needle_job_resumes_and_runs_full_once(tmp_path):
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    args = (model, tokenizer, FILLER, ["full", "window"], [16], [0.0, 1.0], 60, 2, tmp_path)
    rows = needle_job(*args)
    assert [(r["policy"], r["budget"], r["depth"]) for r in rows] == [
        ("full", None, 0.0),
        ("full", None, 1.0),
        ("window", 16, 0.0),
        ("window", 16, 1.0),
    ]
    assert all(0 <= r["accuracy"] <= 1 and r["trials"] == 2 for r in rows)
    calls = []
    needle_job(*args, progress=calls.append)
    assert calls == []  # every cell was done already
