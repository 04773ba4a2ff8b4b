"""Calibration on two gloo ranks (torchrun) gives what one process gives."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from sparsegen.layerwise import InputStats

pytestmark = pytest.mark.slow  # torchrun ranks and spawned processes


def run_cli(*args: str, ranks: int = 1) -> None:
    """Run the CLI in one process, or on `ranks` gloo ranks under torchrun; each process on one
    thread, as torchrun sets it (SparseGPT's masks follow the last bits of the GEMMs, which
    change with the thread count: on SmolLM2, 1 thread against 2 moves 7.6% of them)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    command = [sys.executable, *launcher, "-m", "sparsegen", *args]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]


def linear_weights(folder) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(folder.glob("model*.safetensors")):
        state.update(load_file(str(file)))
    return {name: t for name, t in state.items() if ".layers." in name and t.dim() == 2}


def pruned_on_one_and_two_ranks(folder, text, tmp_path, method, *extra):
    common = ["prune", "--model", str(folder), "--method", method, "--calib-text", str(text)]
    common += ["--n-samples", "4", "--seqlen", "32", *extra]
    run_cli(*common, "--out", str(tmp_path / "one"))
    run_cli(*common, "--out", str(tmp_path / "two"), ranks=2)
    return linear_weights(tmp_path / "one"), linear_weights(tmp_path / "two")


@pytest.mark.parametrize("where", ["--in-memory", "--from-disk"])
def test_two_ranks_give_the_same_wanda_masks(tiny_folder, tiny_text, tmp_path, where):
    one, two = pruned_on_one_and_two_ranks(tiny_folder, tiny_text, tmp_path, "wanda", where)
    assert one.keys() == two.keys() and len(one) == 21
    for name in one:
        assert torch.equal(one[name], two[name]), name


def test_two_ranks_give_sparsegpt_masks_within_a_tenth_of_a_percent(tiny_folder, tiny_text, tmp_path):
    one, two = pruned_on_one_and_two_ranks(tiny_folder, tiny_text, tmp_path, "sparsegpt")
    differ = sum(int(((one[n] == 0) != (two[n] == 0)).sum()) for n in one)
    assert differ < 1e-3 * sum(t.numel() for t in one.values())
    assert all((two[n] == 0).float().mean() == pytest.approx(0.5, abs=0.01) for n in two)


def _reduce_on_rank(rank: int, store: str, samples: torch.Tensor, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    stats = InputStats(8, need_hessian=True)
    stats.add(samples[rank::2])
    stats.all_reduce()
    torch.save(stats, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_all_reduced_statistics_of_two_shares_are_those_of_the_whole(tmp_path):
    samples = torch.randn(6, 10, 8)
    whole = InputStats(8, need_hessian=True)
    whole.add(samples)
    mp.spawn(_reduce_on_rank, args=(str(tmp_path / "store"), samples, str(tmp_path)), nprocs=2)
    for rank in range(2):
        reduced = torch.load(tmp_path / f"{rank}.pt", weights_only=False)
        assert reduced.samples == whole.samples == 60
        assert torch.allclose(reduced.sq_norm, whole.sq_norm, rtol=1e-12)
        assert torch.allclose(reduced.hessian, whole.hessian, rtol=1e-12)


def test_two_ranks_quantize_with_gptq_as_one_process(tiny_folder, tiny_text, tmp_path):
    common = ["quantize", "--model", str(tiny_folder), "--method", "gptq", "--group-size", "32"]
    common += ["--calib-text", str(tiny_text), "--n-samples", "4", "--seqlen", "32"]
    run_cli(*common, "--out", str(tmp_path / "one"))
    run_cli(*common, "--out", str(tmp_path / "two"), ranks=2)
    one, two = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert one.keys() == two.keys() and any(name.endswith("weight_packed") for name in one)
    for name in one:
        assert torch.equal(one[name], two[name]), name
