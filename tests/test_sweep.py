"""Sweeps on a local Ray: each cell's metrics are those of the cell run alone; a killed sweep resumes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from sparsegen.errors import SparsegenError
from sparsegen.scale.sweep import cells_of, run_cell

pytest.importorskip("ray")
pytestmark = pytest.mark.slow


def _grid(folder, text) -> dict:
    return {
        "model": str(folder),
        "calibration": {"text": str(text), "n_samples": 4, "seqlen": 32},
        "prune": [None, {"method": "wanda", "sparsity": 0.5}],
        "quantize": [None, {"bits": 4, "group_size": 32}],
        "kv": [{"policy": "full"}, {"policy": "window", "budget": 24}],
        "evaluations": [
            {"kind": "ppl", "text": str(text), "seqlen": 64},
            {"kind": "stream_ppl", "text": str(text), "tokens": 96},
        ],
    }


def test_the_grid_has_one_cell_per_combination_and_kv_blind_evaluations_once():
    grid = {"model": "m", "prune": [None, {}], "quantize": [None], "kv": [{"policy": "full"}, {"policy": "h2o"}]}
    grid["evaluations"] = [{"kind": "ppl"}, {"kind": "needle"}]
    cells = cells_of(grid)
    assert len(cells) == 2 * (1 + 2)
    assert len({cell.key for cell in cells}) == len(cells)
    with pytest.raises(SparsegenError, match="unknown evaluation 'bleu'"):
        cells_of({**grid, "evaluations": [{"kind": "bleu"}]})


def _sweep(grid_file, out):
    return subprocess.Popen(
        [sys.executable, "-m", "sparsegen", "sweep", str(grid_file), "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_sweep_reproduces_cells_run_alone_and_resumes_after_a_kill(tiny_folder, tiny_text, tmp_path):
    grid = _grid(tiny_folder, tiny_text)
    cells = cells_of(grid)
    assert len(cells) == 12  # 2 prune x 2 quantize x (ppl + stream_ppl under 2 policies)
    grid_file = tmp_path / "grid.yaml"
    grid_file.write_text(yaml.safe_dump(grid))
    out = tmp_path / "sweep"

    first = _sweep(grid_file, out)
    deadline = time.time() + 300
    while time.time() < deadline and len(list((out / "cells").glob("*.json"))) < 3 and first.poll() is None:
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    finished = {path.name: path.stat().st_mtime_ns for path in (out / "cells").glob("*.json")}
    assert 3 <= len(finished) < len(cells), "the sweep was not killed halfway"

    second = _sweep(grid_file, out)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr[-2000:]
    assert f"{len(finished)} done earlier, {len(cells) - len(finished)} to run" in stderr
    for name, mtime in finished.items():
        assert (out / "cells" / name).stat().st_mtime_ns == mtime  # not run again
    assert (out / "sweep.md").exists() and (out / "sweep.png").stat().st_size > 0

    for cell in cells:
        saved = json.loads((out / "cells" / f"{cell.key}.json").read_text())["metrics"]
        assert saved == run_cell(grid["model"], grid["calibration"], cell)
