"""Pruning the real default model: the standard ordering of methods holds."""

import pytest
import torch

import sparsegen
from sparsegen.data import calibration_samples, load_text, tokenize_long
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.prune import PRUNERS, prune

pytestmark = pytest.mark.real


def test_wanda_and_sparsegpt_beat_magnitude_on_smollm2(real):
    _, tokenizer = real
    text = load_text("shakespeare")
    calibration = calibration_samples(tokenizer, text[:2_000_000], n_samples=4, seqlen=128, seed=0)
    held_out = tokenize_long(tokenizer, text[-300_000:])
    ppl = {}
    for method in sorted(PRUNERS):
        model, _ = sparsegen.load(dtype=torch.float32)
        report = prune(model, method, 0.5, calibration=calibration, progress=False)
        assert report.overall == pytest.approx(0.5, abs=1e-3)
        ppl[method] = windowed_ppl(model, held_out, seqlen=256, max_windows=4, progress=False).ppl
    dense, _ = sparsegen.load(dtype=torch.float32)
    ppl["dense"] = windowed_ppl(dense, held_out, seqlen=256, max_windows=4, progress=False).ppl
    assert ppl["dense"] < ppl["sparsegpt"] and ppl["dense"] < ppl["wanda"]
    assert ppl["wanda"] < 0.5 * ppl["magnitude"] and ppl["sparsegpt"] < 0.5 * ppl["magnitude"]
    assert torch.isfinite(torch.tensor(list(ppl.values()))).all()
