"""`sparsegen eval ruler`: RULER's generators and metrics, one prefill per sample, resuming."""

import json

import pytest

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
    """A 4-bit run equals reading each cell alone in 4 bits; a results file written before
    `kv_bits` existed resumes as the full-precision run it was."""
    model, tokenizer = build_tiny("llama"), tiny_tokenizer()
    monkeypatch.setattr(ruler, "make_samples", _fixed_samples)
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
