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

from sparsegen.contextual.base import LayerStats, Selector, make_selector, mlp_activations, mlp_parts
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
            x = args[0].reshape(-1, args[0].shape[-1])
            gate_act, hidden = mlp_activations(mlp_parts(module), x)
            stats[index].append(LayerStats(x.half(), gate_act.half(), hidden.half()))

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
    if stats is not None:
        bar = tqdm(stats, desc=f"calibrating {selector} {sparsity:.0%}", disable=not progress)
        for layer_stats, chosen in zip(bar, selectors, strict=True):
            if chosen is not None:
                chosen.calibrate(layer_stats)
    install(model, selectors)
    return selectors


def install(model: nn.Module, selectors: list[Selector | None]) -> None:
    """Give each decoder layer a `SparseMLP` with its selector (None: the original, dense MLP)."""
    for layer, selector in zip(decoder_layers(model), selectors, strict=True):
        original = _dense(layer.mlp)
        if selector is None:
            layer.mlp = original
            continue
        layer.mlp = SparseMLP(mlp_parts(original), selector)
        layer.mlp.original = original


def installed_selectors(model: nn.Module) -> list[Selector | None]:
    return [layer.mlp.selector if isinstance(layer.mlp, SparseMLP) else None for layer in decoder_layers(model)]


@torch.no_grad()
def kept_share(model: nn.Module, ids: torch.Tensor) -> float:
    """Mean share of neurons a token of `ids` [1, n] keeps, over all layers (dense ones keep all):
    measured, not the target."""
    shares = []

    def hook(module, args):
        x = args[0].reshape(-1, args[0].shape[-1])
        gate_act, hidden = mlp_activations(mlp_parts(module.original), x)
        shares.append(module.selector.keep(x, gate_act, hidden).float().mean().item())

    selectors = installed_selectors(model)
    sparse = [layer.mlp for layer in decoder_layers(model) if isinstance(layer.mlp, SparseMLP)]
    handles = [mlp.register_forward_pre_hook(hook) for mlp in sparse]
    try:
        model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return (sum(shares) + len(selectors) - len(sparse)) / len(selectors)


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
    selectors: list[Selector | None] = []
    for i in range(len(decoder_layers(model))):
        state = {key.split(".", 1)[1]: value for key, value in tensors.items() if key.split(".", 1)[0] == str(i)}
        selector = None
        if state or meta["selector"] == "oracle":  # the oracle has no state; a layer without one is dense
            selector = make_selector(meta["selector"], float(meta["sparsity"]))
            selector.load_state(state)
        selectors.append(selector)
    install(model, selectors)
    return selectors
