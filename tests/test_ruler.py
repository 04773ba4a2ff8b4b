"""`sparsegen eval ruler`: RULER's generators and metrics, one prefill per sample, resuming."""

import json
import math

import pytest
import torch
from transformers import DynamicCache

from sparsegen.eval import ruler
from sparsegen.eval.ruler import RulerSettings, clean, kept_tokens, ruler_job
from sparsegen.eval.ruler_data import RulerSample, make_samples, task_table
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny, tiny_tokenizer
from tests.test_cli import run_cli

POLICIES = ("full", "streaming", "h2o", "snapkv", "keydiff", "pyramidkv")


def _settings(**changes) -> RulerSettings:
    base = dict(
        model="tiny", tasks=("niah_single_1",), lengths=(400,), samples=1, policies=POLICIES, ratios=(0.5, 0.75)
    )
    return RulerSettings(**{**base, **changes})


def test_rulers_thirteen_tasks_and_metrics_come_from_its_package():
    table = task_table()
    assert len(table) == 13 and {"niah_single_1", "vt", "cwe", "fwe", "qa_2"} <= set(table)
    assert table["niah_multivalue"]["args"]["num_needle_v"] == 4
    assert table["vt"]["metric"](["X1 and X2"], [["x1", "x2", "x3"]]) == [pytest.approx(200 / 3)]
    assert table["qa_1"]["metric"](["Paris"], [["paris", "rome"]]) == [100.0]
    assert clean("  7 \x01 8\n") == "7 \n 8" and kept_tokens(1000, 0.75) == 250 and kept_tokens(3, 0.9) == 1


def _fixed_samples(tokenizer, task, length, samples, seed, work, haystack=None):
    """Two RULER-shaped samples in the tiny vocabulary (the generators have their own test)."""
    context = " ".join(f"w{5 + (i * 7) % 80}" for i in range(150))
    return [
        RulerSample(task, length, index, f"{context} w90 w{91 + index} w6", " w7 w90 w4 w8", [f"w{91 + index}"], 170)
        for index in range(samples)
    ]


@pytest.mark.slow  # RULER's generator scripts run in a process of their own (half a minute each)
def test_samples_split_where_rulers_template_puts_the_question(tmp_path):
    tokenizer = tiny_tokenizer()
    samples = make_samples(tokenizer, "niah_single_1", 400, 2, 42, tmp_path)
    assert len(samples) == 2 and samples[0].references != samples[1].references
    for sample in samples:
        assert sample.question.startswith("What is the special magic number for")
        assert sample.question.endswith("mentioned in the provided text is") and " w4 " in sample.question
        assert "The grass is green" in sample.context and sample.references[0] in sample.context
        assert sample.generator_length <= 400
    again = make_samples(tokenizer, "niah_single_1", 400, 2, 42, tmp_path)  # read back, not generated
    assert again == samples


def test_job_scores_every_cell_resumes_and_equals_separate_prefills(tmp_path, monkeypatch):
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr(ruler, "make_samples", _fixed_samples)
    settings = _settings()
    records = ruler_job(model, tokenizer, settings, tmp_path / "shared", progress=False)
    assert model.config._attn_implementation == "sdpa"  # the model as the job was given it
    cells = 1 + (len(POLICIES) - 1) * 2
    assert len(records) == cells
    assert {(r["policy"], r["ratio"]) for r in records} == {("full", 0.0)} | {
        (p, r) for p in POLICIES[1:] for r in (0.5, 0.75)
    }
    for r in records:
        assert r["budget"] is None or r["budget"] == kept_tokens(r["context_tokens"], r["ratio"])
        assert 0 <= r["score"] <= 100
    saved = json.loads((tmp_path / "shared" / "results.json").read_text())
    assert len(saved["samples"]) == 1 and all(s["references"] and s["prompt"] for s in saved["samples"])

    def fail(*args, **kwargs):
        raise AssertionError("a finished sample was scored again")

    with monkeypatch.context() as patch:
        patch.setattr(ruler, "score_sample", fail)
        assert ruler_job(model, tokenizer, settings, tmp_path / "shared", progress=False) == records

    alone = ruler_job(model, tokenizer, _settings(separate_prefill=True), tmp_path / "alone", progress=False)
    assert sorted((r["policy"], r["ratio"], r["prediction"]) for r in alone) == sorted(
        (r["policy"], r["ratio"], r["prediction"]) for r in records
    )


def test_kv_bits_hold_every_cell_in_that_many_bits_and_older_results_files_resume(tmp_path, monkeypatch):
    """A 4-bit run equals reading each cell alone in 4 bits, over 32 answer tokens (a decode alone
    and one batched with other cells read the rounded keys through different float paths, decoded
    rows plus the row's centre or the byte kernels' products plus q.c, and past that this tiny
    random model's near-ties can tip either way); a results file written before `kv_bits` existed
    resumes as the full-precision run it was."""
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr(ruler, "make_samples", _fixed_samples)
    table = {task: {**setting, "tokens_to_generate": 32} for task, setting in task_table().items()}
    monkeypatch.setattr(ruler, "task_table", lambda: table)
    four = _settings(kv_bits=4, policies=("full", "h2o", "kvzip"))
    records = ruler_job(model, tokenizer, four, tmp_path / "four", progress=False)
    assert {r["kv_bits"] for r in records} == {4}
    for r in records:  # each cell records the spec it ran under, read back whole
        spec = KVSpec.from_dict(r["kv"])
        assert (spec.name, spec.kv_bits, spec.policy.describe()) == (r["policy"], 4, r["setting"])
    alone = ruler_job(
        model,
        tokenizer,
        _settings(kv_bits=4, policies=("full", "h2o", "kvzip"), separate_prefill=True),
        tmp_path / "alone",
        progress=False,
    )
    assert sorted((r["policy"], r["ratio"], r["prediction"]) for r in alone) == sorted(
        (r["policy"], r["ratio"], r["prediction"]) for r in records
    )
    plain = _settings(policies=("full", "h2o"))
    first = ruler_job(model, tokenizer, plain, tmp_path / "plain", progress=False)
    saved = json.loads((tmp_path / "plain" / "results.json").read_text())
    del saved["settings"]["kv_bits"]  # as an older sparsegen wrote it
    (tmp_path / "plain" / "results.json").write_text(json.dumps(saved))
    monkeypatch.setattr(ruler, "score_sample", lambda *args: pytest.fail("a finished sample was scored again"))
    assert ruler_job(model, tokenizer, plain, tmp_path / "plain", progress=False) == first


def _held_by_cell(monkeypatch) -> dict[str, list[dict]]:
    """What each cell's cache holds when its decode starts (per policy name, per layer: the slots'
    positions, keys and values as stored, and the layer's codec), read as `generate` receives it."""
    import sparsegen.decode

    seen, generate = {}, sparsegen.decode.generate

    def spy(model, prompts, steps, policy, *args, held: list, **kwargs):
        for cache in held:
            layers = [(layer.held_slots(), layer.codec, layer.store) for layer in cache.policy_layers()]
            seen[cache.policy.name] = [
                {**{k: v.clone() for k, v in s.items()}, "codec": c, "centre": c and store.centre("keys")}
                for s, c, store in layers
            ]
        return generate(model, prompts, steps, policy, *args, held=held, **kwargs)

    monkeypatch.setattr(sparsegen.decode, "generate", spy)
    return seen


@torch.inference_mode()
def _hf_reference(model, context: list[int], question: list[int], keep: int | None, steps: int):
    """transformers' own model over a `DynamicCache` cut to its newest `keep` tokens before every
    forward (a window of `keep` at original positions; None keeps all): the context's keys and
    values per layer [h, S, d] and the greedy answer's first `steps` tokens."""
    cache = DynamicCache(config=model.config)
    model(torch.tensor([context]), cache=cache, use_cache=True)
    context_kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
    seen, ids, answer = len(context), question, []
    for _ in range(steps):
        for layer in cache.layers if keep is not None else ():
            layer.keys, layer.values = layer.keys[:, :, -keep:], layer.values[:, :, -keep:]
        positions = torch.arange(seen, seen + len(ids))[None]
        logits = model(torch.tensor([ids]), cache=cache, position_ids=positions, use_cache=True).logits
        seen, ids = seen + len(ids), [int(logits[0, -1].argmax())]
        answer.append(ids[0])
    return context_kv, answer


def _sample_ids(tokenizer) -> tuple[list[int], list[int]]:
    sample = _fixed_samples(tokenizer, "niah_single_1", 400, 1, 42, None)[0]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in (sample.context, sample.question)]


def test_a_policy_cell_holds_its_budget_and_answers_from_it_not_from_the_full_cache(monkeypatch, tmp_path):
    """At ratio 0.5 each evicting cell holds kept_tokens positions per head, window the newest ones,
    with the keys and values transformers computes for them; window answers as transformers does
    over a cache cut back to its newest `budget` tokens before every forward, `full` as it does over
    the whole cache, and every evicting cell answers otherwise than `full`."""
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr(ruler, "make_samples", _fixed_samples)
    held = _held_by_cell(monkeypatch)
    records = ruler_job(model, tokenizer, _settings(policies=("full", "window", "h2o"), ratios=(0.5,)), tmp_path, False)
    answers = {r["policy"]: r["prediction"] for r in records}
    context, question = _sample_ids(tokenizer)
    length, budget = len(context), kept_tokens(len(context), 0.5)
    assert {r["context_tokens"] for r in records} == {length} and budget < length
    context_kv, full_answer = _hf_reference(model, context, question, None, 12)
    _, window_answer = _hf_reference(model, context, question, budget, 12)
    kept = {"full": range(length), "window": range(length - budget, length)}
    for name, layers in held.items():
        for layer, (keys, values) in zip(layers, context_kv, strict=True):
            positions = layer["positions"][0]
            assert positions.shape[-1] == len(kept.get(name, range(budget)))
            assert all(sorted(row) == sorted(set(row)) for row in positions.tolist())  # no position twice
            if name in kept:
                assert all(sorted(row) == list(kept[name]) for row in positions.tolist())
            index = positions[..., None].expand(-1, -1, keys.shape[-1])
            torch.testing.assert_close(layer["keys"][0], keys.gather(1, index), atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(layer["values"][0], values.gather(1, index), atol=1e-5, rtol=1e-4)
    heavy = [layer["positions"].sort(-1).values for layer in held["h2o"]]
    assert any(not torch.equal(h, torch.arange(length - budget, length).expand_as(h)) for h in heavy)
    assert answers["full"].split()[:12] == tokenizer.decode(full_answer).split()
    assert answers["window"].split()[:12] == tokenizer.decode(window_answer).split()
    assert answers["window"] != answers["full"] and answers["h2o"] != answers["full"]


def test_kv_bits_hold_each_cell_as_rounded_bytes_and_the_answer_reads_them(monkeypatch, tmp_path):
    """In 4 bits a held key or value is d/2 bytes of codes plus an fp16 scale and minimum per
    group of up to 32 channels, where full precision holds 4 d bytes; decoded, it is off from
    transformers' own vector by more than nothing and by at most what rounding to 15 steps of its
    range allows (range <= 2 |x| under any orthogonal rotation: |error| <= sqrt(d) |x| / 15; keys
    rounded less their row's centre c and decoded plus it, so |x| is |k - c| there); and the answer
    read from those bytes is not the full-precision one."""
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr(ruler, "make_samples", _fixed_samples)
    held = _held_by_cell(monkeypatch)
    exact = ruler_job(model, tokenizer, _settings(policies=("full",)), tmp_path / "exact", False)
    exact_layer = held.pop("full")[0]
    dim = exact_layer["keys"].shape[-1]
    assert exact_layer["codec"] is None and exact_layer["keys"].dtype == torch.float32 and dim == 16
    four = ruler_job(model, tokenizer, _settings(policies=("full",), kv_bits=4), tmp_path / "four", False)
    context, question = _sample_ids(tokenizer)
    context_kv, _ = _hf_reference(model, context, question, None, 1)
    worst = 0.0
    for layer, reference in zip(held["full"], context_kv, strict=True):
        assert layer["positions"][0].tolist() == [list(range(len(context)))] * len(layer["positions"][0])
        centre = layer["centre"][0]  # [h, d]: keys are rounded less it, values as they are
        shifts = (centre[:, None], torch.zeros_like(centre)[:, None])
        for stored, truth, shift in zip((layer["keys"], layer["values"]), reference, shifts, strict=True):
            assert stored.dtype == torch.uint8 and stored.shape[-1] == dim // 2 + 4 * math.ceil(dim / 32)
            error = (layer["codec"].decode(stored[0]) + shift - truth).norm(dim=-1)
            assert bool((error <= math.sqrt(dim) * (truth - shift).norm(dim=-1) / 15 * 1.01 + 1e-4).all())
            worst = max(worst, float((error / truth.norm(dim=-1)).max()))
    assert worst > 1e-3  # rounded, not held exactly
    assert four[0]["kv_bits"] == 4 and four[0]["prediction"] != exact[0]["prediction"]


@pytest.mark.slow  # RULER's generator runs in a process of its own
def test_eval_ruler_command_writes_table_plot_and_json(monkeypatch, capsys, tiny_folder, tmp_path):
    args = ["eval", "ruler", "--model", tiny_folder, "--tasks", "niah_single_1", "--lengths", "400"]
    args += ["--samples", "1", "--policies", "full,tova", "--ratios", "0.5", "--out", tmp_path]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "RULER at 400 tokens" in out and "tova" in out
    assert (tmp_path / "ruler_400.png").stat().st_size > 0 and "| tova | 0.500 |" in (
        tmp_path / "results.md"
    ).read_text()
    code, _, err = run_cli(monkeypatch, capsys, *args, "--protocol", "query-first")
    assert code == 2 and "--protocol must be one of" in err and "Traceback" not in err
    code, _, err = run_cli(monkeypatch, capsys, "eval", "ruler", "--model", tiny_folder, "--tasks", "niah_9")
    assert code == 2 and "unknown RULER task niah_9" in err
