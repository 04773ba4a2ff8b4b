"""Sparse checkpoints: a transformers folder whose config carries the sparsity metadata.

The default stores dense weights, so plain `AutoModelForCausalLM.from_pretrained(DIR)` loads it.
`compressed=True` stores each pruned matrix as a bitmask plus its non-zero values (a smaller
file); such a folder is loaded with `sparsegen.load(DIR)`, which expands it.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from sparsegen.prune.pipeline import PruneReport

COMPRESSED_FILE = "model.sparse.safetensors"


def sparsity_config(report: PruneReport, compressed: bool) -> dict:
    """The metadata stored in config.json, after compressed-tensors' sparsity_config."""
    data = asdict(report)
    return {
        "format": "sparse-bitmask" if compressed else "dense",
        "sparsity_structure": report.pattern,
        "global_sparsity": report.overall,
        "targets": ["Linear"],
        "ignore": ["lm_head", "embed_tokens"],
        "method": report.method,
        "settings": report.settings,
        "owl": report.owl,
        "calibration": {"n_samples": report.n_samples, "seqlen": report.seqlen},
        "layer_sparsity": data["layers"],
    }


def _compress(state: dict[str, torch.Tensor], pruned: set[str]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name not in pruned:
            out[name] = tensor
            continue
        flat = tensor.flatten()
        keep = flat != 0
        out[f"{name}.bitmask"] = torch.from_numpy(np.packbits(keep.numpy()))
        out[f"{name}.values"] = flat[keep].clone()
        out[f"{name}.shape"] = torch.tensor(tensor.shape)
    return out


def expand_compressed(folder: str | Path) -> dict[str, torch.Tensor]:
    """The dense state dict of a compressed sparse checkpoint."""
    packed = load_file(str(Path(folder) / COMPRESSED_FILE))
    state = {}
    for name, tensor in packed.items():
        if name.endswith((".values", ".shape")):
            continue
        if name.endswith(".bitmask"):
            base = name[: -len(".bitmask")]
            shape = packed[f"{base}.shape"].tolist()
            count = int(np.prod(shape))
            keep = torch.from_numpy(np.unpackbits(tensor.numpy(), count=count).astype(bool))
            values = packed[f"{base}.values"]
            dense = torch.zeros(count, dtype=values.dtype)
            dense[keep] = values
            state[base] = dense.reshape(shape)
        else:
            state[name] = tensor
    return state


def save_pruned(model, tokenizer, out: str | Path, report: PruneReport, compressed: bool = False) -> Path:
    """Write the pruned model (and tokenizer) to `out` atomically; returns the folder."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.config.sparsity_config = sparsity_config(report, compressed)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        folder = Path(tmp) / "model"
        model.save_pretrained(folder)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
        if compressed:
            prefixes = {
                f"{name}.weight"
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}."
            }
            state = {}
            for file in folder.glob("model*.safetensors"):
                state.update(load_file(str(file)))
                file.unlink()
            index = folder / "model.safetensors.index.json"
            index.unlink(missing_ok=True)
            pruned = {name for name in state if name in prefixes}
            save_file(_compress(state, pruned), str(folder / COMPRESSED_FILE), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        os.replace(folder, out)
    return out


def is_compressed(folder: str | Path) -> bool:
    config = Path(folder) / "config.json"
    if not config.exists():
        return False
    return json.loads(config.read_text()).get("sparsity_config", {}).get("format") == "sparse-bitmask"
