"""Contextual sparsity on the real default model: everything kept generates the dense tokens, and a
calibrated threshold keeps about the asked share of neurons."""

import pytest
import torch

from sparsegen.contextual import densify, sparsify
from sparsegen.data import calibration_samples, load_text

pytestmark = pytest.mark.real


def test_everything_kept_equals_dense_and_half_kept_differs(real):
    model, tokenizer = real
    prompt = tokenizer("The quality of mercy is not strained;", return_tensors="pt").input_ids
    calibration = calibration_samples(tokenizer, load_text("shakespeare")[:300_000], 2, 128, seed=0)
    dense = model.generate(prompt, max_new_tokens=20, do_sample=False)
    try:
        sparsify(model, "threshold", 0.0, calibration, progress=False)
        assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False), dense)
        sparsify(model, "threshold", 0.5, calibration, progress=False)
        halved = model.generate(prompt, max_new_tokens=20, do_sample=False)
        assert not torch.equal(halved, dense) and torch.equal(halved[:, : prompt.shape[1]], prompt)
    finally:
        densify(model)


def test_teal_on_the_fast_path_matches_transformers_and_reads_what_it_says(real):
    from sparsegen.contextual.apply import read_bytes
    from sparsegen.decode import generate

    model, tokenizer = real
    prompt = tokenizer("Of man's first disobedience, and the fruit", return_tensors="pt").input_ids
    dense = generate(model, prompt, 16, compile="never", eos_token_id=[]).tokens[0]
    try:
        sparsify(model, "teal", 0.25, progress=False)
        read, total = read_bytes(model, prompt)
        assert read / total == pytest.approx(0.75, abs=0.01)
        # fp32 keys and values, as transformers' cache holds them (the CPU default is fp16 here)
        fast = generate(model, prompt, 16, compile="never", eos_token_id=[], kv_dtype=torch.float32).tokens[0]
        reference = model.generate(prompt, max_new_tokens=16, do_sample=False)[0, prompt.shape[1] :].tolist()
        assert fast == reference and fast != dense
    finally:
        densify(model)
