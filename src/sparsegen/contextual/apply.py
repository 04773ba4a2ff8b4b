"""Calibrate a selector per layer on real text, install sparse MLPs, save and load the selectors.

The selectors' settings are a small safetensors file with the model's shape in its metadata;
loading it into a model of another shape is a clear error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from sparsegen.contextual.base import LayerStats, Selector, make_selector, mlp_parts
from sparsegen.contextual.mlp import SparseMLP
from sparsegen.errors import SparsegenError
from sparsegen.prune.pipeline import decoder_layers

SELECTORS_FILE = "contextual.safetensors"


@torch.no_grad()
def collect_stats(model: nn.Module, calibration: torch.Tensor, max_tokens: int = 2048) -> list[LayerStats]:
    """act(gate(x)) and h = act(gate) * up of every MLP for the calibration samples' first
    `max_tokens` tokens (kept in fp16: 2048 tokens of SmolLM2 take 380 MB)."""
    layers = decoder_layers(model)
    stats: list[list[LayerStats]] = [[] for _ in layers]

    def hook(index):
        def record(module, args):
            parts = mlp_parts(module)
            x = args[0].reshape(-1, args[0].shape[-1])
            gate = parts.act(parts.gate(x)) if parts.gate is not None else None
            hidden = gate * parts.up(x) if gate is not None else parts.act(parts.up(x))
            gate = gate if gate is not None else hidden
            stats[index].append(LayerStats(x.half(), gate.half(), hidden.half()))

        return record

    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        seen = 0
        for sample in calibration:
            if seen >= max_tokens:
                break
            model(sample[None], use_cache=False)
            seen += sample.numel()
    finally:
        for handle in handles:
            handle.remove()
    return [
        LayerStats(*(torch.cat([getattr(s, name) for s in per]) for name in ("inputs", "gate_act", "hidden")))
        for per in stats
    ]


def sparsify(
    model: nn.Module,
    selector: str,
    sparsity: float,
    calibration: torch.Tensor | None = None,
    dense_layers: int = 0,
    progress: bool = True,
) -> list[Selector]:
    """Swap every decoder MLP (after the first `dense_layers`) for a `SparseMLP` whose selector was
    calibrated on `calibration` ids [n, seqlen]; returns the selectors (None for dense layers)."""
    densify(model)
    layers = decoder_layers(model)
    for layer in layers:
        mlp_parts(layer.mlp)
    selectors = [make_selector(selector, sparsity) if i >= dense_layers else None for i in range(len(layers))]
    stats = collect_stats(model, calibration) if calibration is not None else None
    for i, layer in enumerate(tqdm(layers, desc=f"{selector} {sparsity:.0%}", disable=not progress)):
        if selectors[i] is None:
            layer.mlp = _dense(layer.mlp)
            continue
        if stats is not None:
            selectors[i].calibrate(stats[i])
        layer.mlp = _install(layer.mlp, selectors[i])
    return selectors


def _install(mlp: nn.Module, selector: Selector) -> SparseMLP:
    original = _dense(mlp)
    sparse = SparseMLP(mlp_parts(original), selector)
    sparse.original = original
    return sparse


def densify(model: nn.Module) -> None:
    """Put the original MLPs back."""
    for layer in decoder_layers(model):
        layer.mlp = _dense(layer.mlp)


def _dense(mlp: nn.Module) -> nn.Module:
    return mlp.original if isinstance(mlp, SparseMLP) else mlp


def _shape(model: nn.Module) -> dict:
    layers = decoder_layers(model)
    return {
        "layers": len(layers),
        "hidden": model.config.hidden_size,
        "neurons": mlp_parts(_dense(layers[0].mlp)).neurons,
    }


def save_selectors(
    model: nn.Module, selectors: list[Selector | None], folder: str | Path, selector: str, sparsity: float
):
    """Write the selectors' settings next to a model (`folder`/contextual.safetensors)."""
    tensors = {
        f"{i}.{name}": value.contiguous()
        for i, s in enumerate(selectors)
        if s is not None
        for name, value in s.state().items()
    }
    meta = {"selector": selector, "sparsity": str(sparsity), "shape": json.dumps(_shape(model))}
    path = Path(folder) / SELECTORS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_selectors(model: nn.Module, folder: str | Path) -> list[Selector | None]:
    """Install the selectors saved in `folder` into `model` (its MLPs become sparse)."""
    from safetensors import safe_open

    path = Path(folder) / SELECTORS_FILE
    if not path.is_file():
        raise SparsegenError(f"no {SELECTORS_FILE} in {folder}: make one with `sparsegen contextual train`")
    try:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata()
        tensors = load_file(str(path))
    except SafetensorError as exc:
        raise SparsegenError(f"{path} is truncated or corrupt ({exc}); train the selectors again") from None
    saved, here = json.loads(meta["shape"]), _shape(model)
    if saved != here:
        raise SparsegenError(
            f"{path} was made for another model ({saved}), not this one ({here}): train selectors for this model"
        )
    layers = decoder_layers(model)
    selectors: list[Selector | None] = []
    for i, layer in enumerate(layers):
        state = {key.split(".", 1)[1]: value for key, value in tensors.items() if key.split(".", 1)[0] == str(i)}
        if not state and meta["selector"] != "oracle":
            layer.mlp, _ = _dense(layer.mlp), selectors.append(None)
            continue
        selector = make_selector(meta["selector"], float(meta["sparsity"]))
        selector.load_state(state)
        selectors.append(selector)
        layer.mlp = _install(layer.mlp, selector)
    return selectors
