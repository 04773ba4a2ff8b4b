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
from sparsegen.contextual.teal import InputSparseLinear
from sparsegen.contextual.teal import uninstall as uninstall_inputs
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
    calibrates = type(selectors[-1]).calibrate is not Selector.calibrate
    stats = collect_stats(model, calibration) if calibration is not None and calibrates else None
    if stats is not None:
        bar = tqdm(stats, desc=f"calibrating {selector} {sparsity:.0%}", disable=not progress)
        for layer_stats, chosen in zip(bar, selectors, strict=True):
            if chosen is not None:
                chosen.calibrate(layer_stats)
    install(model, selectors)
    return selectors


def install(model: nn.Module, selectors: list[Selector | None]) -> None:
    """Put each selector into its decoder layer (None: the layer stays dense)."""
    densify(model)
    for layer, selector in zip(decoder_layers(model), selectors, strict=True):
        if selector is not None:
            selector.install(layer)


def installed_selectors(model: nn.Module) -> list[Selector | None]:
    return [getattr(layer.mlp, "selector", None) for layer in decoder_layers(model)]


@torch.no_grad()
def layer_kept_shares(model: nn.Module, ids: torch.Tensor) -> list[float]:
    """Per decoder layer, the mean share of MLP neurons a step over `ids` [b, n] computes (dense
    layers: all); the b rows of one step share the union of their sets. Measured, not the target."""
    layers = decoder_layers(model)
    shares = [1.0] * len(layers)

    def hook(index, selector):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            gate_act, hidden = mlp_activations(mlp_parts(_dense(module)), x)
            keep = selector.keep(x, gate_act, hidden).view(*ids.shape, -1).any(0)
            shares[index] = keep.float().mean().item()

        return record

    handles = [
        layer.mlp.register_forward_pre_hook(hook(i, selector))
        for i, (layer, selector) in enumerate(zip(layers, installed_selectors(model), strict=True))
        if selector is not None
    ]
    try:
        model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return shares


def read_bytes(model: nn.Module, ids: torch.Tensor, shares: list[float] | None = None) -> tuple[float, float]:
    """Bytes of decoder-layer weights one decode step of the rows `ids` [b, n] reads, and of all of
    them: a SparseMLP reads its kept neurons' rows (and the whole gate if its selector needs it), an
    InputSparseLinear its kept inputs' rows at one row (all of them for more), anything else all.
    `shares` are `layer_kept_shares(model, ids)` when the caller has them already."""
    shares = layer_kept_shares(model, ids) if shares is None else shares
    read = total = 0.0
    for layer, share in zip(decoder_layers(model), shares, strict=True):
        wrappers = [m for m in layer.modules() if isinstance(m, SparseMLP | InputSparseLinear)]
        inside = {id(m) for wrapper in wrappers for m in wrapper.modules() if m is not wrapper}  # counted there
        for module in layer.modules():
            if isinstance(module, SparseMLP):
                for name, linear in (("gate", module.parts.gate), ("up", module.parts.up), ("down", module.parts.down)):
                    if linear is None:
                        continue
                    size = linear.weight.numel() * linear.weight.element_size()
                    whole = module.selector.needs_hidden or name == "gate" and module.selector.needs_gate
                    read, total = read + size * (1.0 if whole else share), total + size
            elif isinstance(module, InputSparseLinear):
                size = module.original.weight.numel() * module.original.weight.element_size()
                read, total = read + size * (module.read_share if ids.shape[0] == 1 else 1.0), total + size
            elif isinstance(module, nn.Linear) and id(module) not in inside:
                size = module.weight.numel() * module.weight.element_size()
                read, total = read + size, total + size
    return read, total


def densify(model: nn.Module) -> None:
    """Put the original MLPs and projections back."""
    for layer in decoder_layers(model):
        uninstall_inputs(layer)
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
    meta = {
        "selector": selector,
        "sparsity": str(sparsity),
        "shape": json.dumps(_shape(model)),
        "sparse_layers": json.dumps([i for i, s in enumerate(selectors) if s is not None]),
    }
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
    selectors: list[Selector | None] = [None] * len(decoder_layers(model))
    for i in json.loads(meta["sparse_layers"]):
        state = {key.split(".", 1)[1]: value for key, value in tensors.items() if key.split(".", 1)[0] == str(i)}
        selectors[i] = make_selector(meta["selector"], float(meta["sparsity"]))
        selectors[i].load_state(state)
    install(model, selectors)
    return selectors
