"""Models larger than RAM: the block-at-a-time path from disk equals the in-memory path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny, tiny_tokenizer
from safetensors.torch import load_file

from sparsegen import load
from sparsegen.errors import SparsegenError
from sparsegen.eval.perplexity import windowed_ppl
from sparsegen.layerwise import Hidden
from sparsegen.prune import PRUNERS, prune
from sparsegen.prune.checkpoint import save_pruned
from sparsegen.quant import QUANTIZERS, quantize
from sparsegen.quant.checkpoint import finish_quantized, save_quantized
from sparsegen.random_model import write_random_llama
from sparsegen.scale import DiskBlocks, open_lazy


def _calibration(n=4, seqlen=24, seed=0):
    return torch.randint(3, 90, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _saved(arch, tmp_path, shard="40KB"):
    """A tiny model saved in several shards, and the same model in memory."""
    folder = tmp_path / f"{arch}-src"
    build_tiny(arch).save_pretrained(folder, max_shard_size=shard)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def _state(folder):
    state = {}
    for file in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(str(file)))
    return state


@pytest.mark.parametrize("method", sorted(PRUNERS))
def test_pruning_from_disk_equals_pruning_in_memory(arch, method, tmp_path):
    folder = _saved(arch, tmp_path)
    assert len(list(folder.glob("model*.safetensors"))) > 2
    model, tokenizer = load(str(folder), dtype=torch.float32)
    report = prune(model, method, 0.5, calibration=_calibration(), progress=False)
    save_pruned(model, tokenizer, tmp_path / "memory", report)

    lazy, _, checkpoint = open_lazy(str(folder))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "disk", job={"method": method})
    disk_report = prune(lazy, method, 0.5, calibration=_calibration(), progress=False, blocks=blocks)
    blocks.finish()
    assert disk_report.layers == report.layers
    memory, disk = _state(tmp_path / "memory"), _state(tmp_path / "disk")
    assert memory.keys() == disk.keys()
    for name in memory:
        assert torch.equal(memory[name], disk[name]), name
    reloaded, _ = load(str(tmp_path / "disk"), dtype=torch.float32)
    ids = _calibration(1, 16, seed=3)
    assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_a_killed_run_resumes_at_the_first_unwritten_block(tmp_path, monkeypatch):
    folder = _saved("llama", tmp_path)
    lazy, _, checkpoint = open_lazy(str(folder))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "out", job={"method": "sparsegpt"})
    calls = []
    real_rewrite = type(blocks).held

    def dies_at_block_two(self, index, block, codec=None):
        calls.append(index)
        if index == 2:
            raise KeyboardInterrupt
        return real_rewrite(self, index, block, codec)

    monkeypatch.setattr(DiskBlocks, "held", dies_at_block_two)
    with pytest.raises(KeyboardInterrupt):
        prune(lazy, "sparsegpt", 0.5, calibration=_calibration(), progress=False, blocks=blocks)
    monkeypatch.undo()
    lazy, _, checkpoint = open_lazy(str(folder))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "out", job={"method": "sparsegpt"})
    assert blocks.finished == {0, 1} and not (tmp_path / "out").exists()
    rewritten = []
    pruner_calls = prune.__globals__["make_pruner"]("sparsegpt")
    original = type(pruner_calls).prune_weight
    monkeypatch.setattr(type(pruner_calls), "prune_weight", lambda s, w, *a: rewritten.append(1) or original(s, w, *a))
    prune(lazy, "sparsegpt", 0.5, calibration=_calibration(), progress=False, blocks=blocks)
    blocks.finish()
    assert len(rewritten) == 7  # one block of seven Linears was left to prune

    model, tokenizer = load(str(folder), dtype=torch.float32)
    monkeypatch.undo()
    prune(model, "sparsegpt", 0.5, calibration=_calibration(), progress=False)
    for name, tensor in _state(tmp_path / "out").items():
        assert torch.equal(tensor, model.state_dict()[name]), name


def test_a_partial_run_with_other_settings_is_refused(tmp_path):
    folder = _saved("llama", tmp_path)
    lazy, _, checkpoint = open_lazy(str(folder))
    DiskBlocks(lazy, checkpoint, tmp_path / "out", job={"sparsity": 0.5})
    with pytest.raises(SparsegenError, match="interrupted run with other settings"):
        DiskBlocks(lazy, checkpoint, tmp_path / "out", job={"sparsity": 0.6})


@pytest.mark.parametrize("method", sorted(QUANTIZERS))
def test_quantizing_from_disk_writes_the_checkpoint_save_quantized_writes(method, tmp_path):
    folder = _saved("qwen2", tmp_path)
    model, tokenizer = load(str(folder), packed=False)
    report = quantize(model, method, 4, 32, calibration=_calibration(), progress=False)
    save_quantized(model, tokenizer, tmp_path / "memory", report)

    lazy, _, checkpoint = open_lazy(str(folder))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "disk", job={})
    disk_report = quantize(lazy, method, 4, 32, calibration=_calibration(), progress=False, blocks=blocks)
    finish_quantized(blocks, disk_report)
    memory, disk = _state(tmp_path / "memory"), _state(tmp_path / "disk")
    assert memory.keys() == disk.keys()
    for name in memory:
        assert torch.equal(memory[name], disk[name]), name
    ids = _calibration(1, 16, seed=3)
    first, _ = load(str(tmp_path / "memory"), dtype=torch.float32)
    second, _ = load(str(tmp_path / "disk"), dtype=torch.float32)
    assert torch.equal(first(ids).logits, second(ids).logits)


def test_layerwise_perplexity_equals_the_whole_model(arch, tmp_path):
    folder = _saved(arch, tmp_path)
    ids = _calibration(1, 200, seed=4)[0]
    model, _ = load(str(folder), dtype=torch.float32)
    expected = windowed_ppl(model, ids, 48, progress=False)
    lazy, _, checkpoint = open_lazy(str(folder))
    got = windowed_ppl(lazy, ids, 48, progress=False, blocks=DiskBlocks(lazy, checkpoint))
    assert got.windows == expected.windows == 4
    assert got.ppl == pytest.approx(expected.ppl, rel=1e-5)


def test_hidden_states_spill_to_files_and_read_back(tmp_path):
    tensors = [torch.randn(2, 5, 8), torch.randn(1, 5, 8).to(torch.bfloat16)]
    hidden = Hidden(spill=True)
    for tensor in tensors:
        hidden.append(tensor)
    folder = Path(hidden._folder)
    assert len(list(folder.iterdir())) == 2
    for got, want in zip(hidden, tensors, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    hidden.close()
    assert not folder.exists()


def test_pruning_with_spilled_hidden_states_is_unchanged(tmp_path, monkeypatch):
    folder = _saved("mistral", tmp_path)
    model, _ = load(str(folder), dtype=torch.float32)
    prune(model, "wanda", 0.5, calibration=_calibration(), progress=False)
    monkeypatch.setattr("sparsegen.layerwise.SPILL_SHARE", 0.0)
    spilled = []
    monkeypatch.setattr(Hidden, "like", lambda self: spilled.append(self.spilled) or Hidden(self.spilled))
    lazy, _, checkpoint = open_lazy(str(folder))
    blocks = DiskBlocks(lazy, checkpoint, tmp_path / "out", job={})
    prune(lazy, "wanda", 0.5, calibration=_calibration(), progress=False, blocks=blocks)
    blocks.finish()
    assert spilled and all(spilled)
    for name, tensor in _state(tmp_path / "out").items():
        assert torch.equal(tensor, model.state_dict()[name]), name


@pytest.mark.slow  # measures its memory in a process of its own
def test_a_model_of_hundreds_of_mb_prunes_from_disk_holding_a_fraction_of_it(tmp_path, tiny_text):
    """Peak RSS stays well under the weights' size, and what it adds to the imports under a third."""
    shape = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=20, num_attention_heads=8)
    folder = write_random_llama(tmp_path / "m", shape, tiny_tokenizer(), progress=False)
    size_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    probe = (
        "import atexit, os, sys; import sparsegen.cli, sparsegen.scale.disk, sparsegen.prune;"
        "from transformers import LlamaForCausalLM;"
        "from sparsegen.rss import peak_rss_mb, rss_mb; base = rss_mb(os.getpid());"
        "atexit.register(lambda: print('RSS', base, peak_rss_mb(), file=sys.stderr));"
        "sys.argv = ['sparsegen', *sys.argv[1:]]; sparsegen.cli.main()"
    )
    args = ["prune", "--model", str(folder), "--from-disk", "--calib-text", str(tiny_text)]
    args += ["--n-samples", "4", "--seqlen", "64", "--out", str(tmp_path / "p")]
    done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    base, peak = (float(v) for v in done.stderr.rsplit("RSS ", 1)[1].split())
    assert size_mb > 1200 and peak < 0.7 * size_mb and peak - base < size_mb / 3, (size_mb, base, peak)
    pruned = _state(tmp_path / "p")
    assert all((t == 0).sum(1).eq(t.shape[1] // 2).all() for n, t in pruned.items() if n.endswith("proj.weight"))
