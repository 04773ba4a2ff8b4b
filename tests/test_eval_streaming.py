import json
import math

import pytest
import torch

from sparsegen.errors import SparsegenError
from sparsegen.eval import PolicyRun, recompute_nll, stream_compare, stream_ppl
from sparsegen.eval.main_job import per_million, stream_ids
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny, tiny_tokenizer


def _dense_nll(model, ids):
    with torch.no_grad():
        logp = model(ids[None]).logits[0].float().log_softmax(-1)
    return -logp[:-1].gather(-1, ids[1:, None])[:, 0]


@pytest.fixture
def ids():
    return torch.randint(3, 96, (90,), generator=torch.Generator().manual_seed(0))


def test_full_and_large_budgets_reproduce_dense_nll(arch, ids):
    model = build_tiny(arch)
    dense = _dense_nll(model, ids)
    runs = [
        PolicyRun("full", "full"),
        PolicyRun("streaming", KVSpec.of("streaming", sinks=4, recent=500)),
        PolicyRun("h2o", KVSpec.of("h2o", heavy=200, recent=200)),
    ]
    results = stream_compare(model, ids, runs, chunk=7, reference="full", progress=False)
    for result in results.values():
        torch.testing.assert_close(torch.tensor(result.nll), dense, rtol=1e-4, atol=1e-4)
        assert result.tokens == 89 and result.chunk == 7
        assert math.isclose(result.ppl, math.exp(dense.mean().item()), rel_tol=1e-4)
    assert results["streaming"].kl == pytest.approx(0, abs=1e-6) and results["streaming"].top1 == 1.0
    assert results["full"].kl is None


def test_small_window_differs_and_is_measured_against_full(ids):
    model = build_tiny("llama")
    runs = [PolicyRun("full", "full"), PolicyRun("window", KVSpec.of("window", recent=8))]
    results = stream_compare(model, ids, runs, chunk=1, reference="full", progress=False)
    assert results["window"].kl > 0 and results["window"].top1 < 1.0
    assert results["window"].kv_mb < results["full"].kv_mb
    assert results["window"].fidelity_tokens == 89


def test_recompute_baseline_matches_manual_windows(ids):
    model = build_tiny("qwen2")
    window = 10
    nll = recompute_nll(model, ids, window, chunk=16)
    manual = []
    with torch.no_grad():
        for t in range(len(ids) - 1):
            context = ids[max(0, t + 1 - window) : t + 1]
            logp = model(context[None]).logits[0, -1].float().log_softmax(-1)
            manual.append(-logp[ids[t + 1]].item())
    torch.testing.assert_close(torch.tensor(nll), torch.tensor(manual), rtol=1e-4, atol=1e-4)
    full = recompute_nll(model, ids, window=1000)
    torch.testing.assert_close(torch.tensor(full), _dense_nll(model, ids), rtol=1e-4, atol=1e-4)


def test_max_tokens_stops_a_run(ids):
    model = build_tiny("llama")
    runs = [PolicyRun("full", "full", max_tokens=40), PolicyRun("s", KVSpec.of("streaming", sinks=2, recent=8))]
    results = stream_compare(model, ids, runs, chunk=16, reference="full", progress=False)
    assert results["full"].tokens == 40 and results["s"].tokens == 89
    assert results["s"].fidelity_tokens == 40


def test_interrupted_run_resumes_with_identical_nll(ids, tmp_path, monkeypatch):
    model = build_tiny("llama")
    runs = [
        PolicyRun("h2o", KVSpec.of("h2o", heavy=6, recent=6)),
        PolicyRun("streaming", KVSpec.of("streaming", sinks=2, recent=10)),
    ]
    clean = stream_compare(model, ids, runs, chunk=5, out_dir=tmp_path / "clean", checkpoint_every=20, progress=False)
    calls = {"n": 0}
    original = model.forward

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 25:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "forward", dying)
    with pytest.raises(KeyboardInterrupt):
        stream_compare(model, ids, runs, chunk=5, out_dir=tmp_path / "run", checkpoint_every=20, progress=False)
    assert (tmp_path / "run" / "stream_state.pt").exists()
    monkeypatch.setattr(model, "forward", original)
    resumed = stream_compare(model, ids, runs, chunk=5, out_dir=tmp_path / "run", checkpoint_every=20, progress=False)
    for label in ("h2o", "streaming"):
        assert list(resumed[label].nll) == pytest.approx(list(clean[label].nll), abs=2e-6)
        on_disk = [float(x) for x in (tmp_path / "run" / f"nll_{label}.txt").read_text().split()]
        assert on_disk == pytest.approx(list(clean[label].nll), abs=2e-6)
    assert not (tmp_path / "run" / "stream_state.pt").exists()


def test_stream_ppl_single_policy(ids):
    model = build_tiny("gemma3")
    result = stream_ppl(model, ids, KVSpec.of("streaming", sinks=2, recent=12), chunk=3, progress=False)
    assert result.tokens == 89 and result.ppl > 1 and len(result.window_ppl) == 1
    json.dumps(result.summary())


def test_bad_stream_inputs_are_clear_errors(ids):
    model = build_tiny("llama")
    with pytest.raises(SparsegenError, match="1-D"):
        stream_compare(model, ids[None], [PolicyRun("f", "full")], progress=False)
    with pytest.raises(SparsegenError, match="unique"):
        stream_compare(model, ids, [PolicyRun("f", "full"), PolicyRun("f", "full")], progress=False)
    with pytest.raises(SparsegenError, match="reference"):
        stream_compare(model, ids, [PolicyRun("f", "full")], reference="x", progress=False)


def test_a_stream_longer_than_its_texts_reads_them_in_turn_and_again(tmp_path):
    """The texts named (commas between) are joined in order and read again from the start as often as
    the stream's length needs: the same ids as tokenizing the joined texts and repeating them."""
    tokenizer = tiny_tokenizer()
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("w5 w6 w7\nw8")
    second.write_text("w9 w10")
    ids, distinct = stream_ids(tokenizer, f"{first}, {second}", 23)
    once = tokenizer(first.read_text() + "\n\n" + second.read_text(), add_special_tokens=False)["input_ids"]
    assert distinct == len(once) < 23
    assert ids.tolist() == (once * 23)[:23]
    with pytest.raises(SparsegenError, match="names no text"):
        stream_ids(tokenizer, " , ", 5)


def test_perplexity_per_block_of_a_stream():
    nll = [0.5, 1.5, 2.0, 1.0, 3.0]
    assert per_million(nll, tokens=2) == pytest.approx([math.exp(1.0), math.exp(1.5), math.exp(3.0)])
