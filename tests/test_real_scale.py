"""The default model pruned block by block from disk: the same masks and perplexity as in memory."""

import pytest
import torch
from safetensors.torch import load_file

import sparsegen
from sparsegen.data import calibration_samples, load_text, tokenize_long
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.models import resolve_model_path
from sparsegen.prune import prune
from sparsegen.scale import DiskBlocks, open_lazy

pytestmark = pytest.mark.real


@pytest.mark.parametrize("method", ["wanda", "sparsegpt"])
def test_pruning_smollm2_from_disk_gives_the_in_memory_masks_and_perplexity(real, method, tmp_path):
    _, tokenizer = real
    text = load_text("shakespeare")
    calibration = calibration_samples(tokenizer, text[:2_000_000], n_samples=4, seqlen=128, seed=0)
    held_out = tokenize_long(tokenizer, text[-300_000:])
    model, _ = sparsegen.load()
    prune(model, method, 0.5, calibration=calibration, progress=False)
    expected = windowed_ppl(model, held_out, seqlen=256, max_windows=3, progress=False).ppl

    lazy, _, checkpoint = open_lazy(resolve_model_path("smollm2-135m"))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "pruned", job={"method": method})
    prune(lazy, method, 0.5, calibration=calibration, progress=False, blocks=blocks)
    blocks.finish()
    state, written = model.state_dict(), {}
    for shard in (tmp_path / "pruned").glob("model-*.safetensors"):
        written.update(load_file(str(shard)))
    assert written.keys() == state.keys() - {"lm_head.weight"}  # tied to the embedding
    assert all(torch.equal(t == 0, state[name] == 0) for name, t in written.items())
    lazy, _, checkpoint = open_lazy(str(tmp_path / "pruned"))
    got = windowed_ppl(lazy, held_out, seqlen=256, max_windows=3, progress=False, blocks=DiskBlocks(lazy, checkpoint))
    assert got.ppl == pytest.approx(expected, rel=1e-4)
