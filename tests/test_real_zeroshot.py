"""Zero-shot on the real default model: lm-eval's own backend agrees, and every kind of model runs."""

import json

import lm_eval
import pytest
import torch
from lm_eval.models.huggingface import HFLM
from test_cli import run_cli

import sparsegen
from sparsegen.eval.harness import SparsegenLM
from sparsegen.eval.tasks import task_manager
from sparsegen.loading import resolve_model_path
from sparsegen.prune import prune
from sparsegen.prune.checkpoint import save_pruned

pytestmark = pytest.mark.real


def _evaluate(model, **kwargs) -> dict:
    result = lm_eval.simple_evaluate(
        model=model, tasks=["copa"], limit=12, task_manager=task_manager(), log_samples=False, **kwargs
    )
    return result["results"]["copa"]


def test_dense_accuracy_equals_lm_evals_transformers_backend(real):
    hf = HFLM(pretrained=resolve_model_path("smollm2-135m"), device="cpu", batch_size=4)
    ours = SparsegenLM(loaded=real, batch_size=4)
    assert _evaluate(ours)["acc,none"] == pytest.approx(_evaluate(hf)["acc,none"], abs=1e-9)


def test_a_pruned_checkpoint_and_an_h2o_cache_run_through_simple_evaluate_and_the_cli(monkeypatch, capsys, tmp_path):
    model, tokenizer = sparsegen.load(dtype=torch.float32)
    report = prune(model, "magnitude", 0.5, progress=False)
    save_pruned(model, tokenizer, tmp_path / "pruned", report, compressed=True)
    pruned = _evaluate("sparsegen", model_args=f"model={tmp_path / 'pruned'},batch_size=4")
    h2o = _evaluate("sparsegen", model_args="policy=h2o,heavy=0.1,recent=0.1")
    for result in (pruned, h2o):
        assert 0 <= result["acc,none"] <= 1 and result["acc_stderr,none"] > 0
    args = ["eval", "zeroshot", "--model", tmp_path / "pruned", "--tasks", "copa", "--limit", "12"]
    code, _, _ = run_cli(monkeypatch, capsys, *args, "--out", tmp_path / "cli")
    summary = json.loads((tmp_path / "cli" / "results.json").read_text())
    assert code == 0 and summary["tasks"]["copa"]["acc"] == pytest.approx(pruned["acc,none"])


def test_eval_zeroshot_command_writes_results_and_resumes(monkeypatch, capsys, tmp_path):
    args = ["eval", "zeroshot", "--tasks", "copa", "--limit", "8", "--policy", "h2o", "--budget", "0.2"]
    code, out, _ = run_cli(monkeypatch, capsys, *args, "--out", tmp_path)
    assert code == 0, out
    summary = json.loads((tmp_path / "results.json").read_text())
    assert summary["settings"]["policy"] == "h2o" and summary["settings"]["budget"] == 0.2
    assert summary["tasks"]["copa"]["items"] == 8
    assert summary["mean_acc"] == summary["tasks"]["copa"]["acc"]
    assert "copa" in out and "mean" in out
    code, _, err = run_cli(monkeypatch, capsys, *args, "--out", tmp_path)
    assert code == 0 and "done earlier, reused" in err
    code, _, err = run_cli(monkeypatch, capsys, "eval", "zeroshot", "--tasks", "copa,nope", "--out", tmp_path)
    assert code == 2 and "unknown zero-shot task(s) nope" in err and "Traceback" not in err
