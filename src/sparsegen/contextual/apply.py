"""Calibrate a selector per layer on real text, install sparse MLPs, save and load the selectors.

The selectors' settings are a small safetensors file with the model's shape in its metadata;
loading it into a model of another shape is a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm

from sparsegen.contextual.fused import engine_format, fuse
from sparsegen.contextual.heads import HeadPredictor, SparseAttention, head_part_norms
from sparsegen.contextual.input_sparse import InputSparseAttention, InputSparseLinear, InputSparseMLP
from sparsegen.contextual.mlp import SparseMLP
from sparsegen.contextual.parts import mlp_activations, mlp_parts
from sparsegen.contextual.selector import LayerStats, Selector, checked_sparsity, make_selector
from sparsegen.errors import SparsegenError
from sparsegen.models import decoder_layers, model_device
from sparsegen.registry import settings_of

SELECTORS_FILE = "contextual.safetensors"
SPARSE_WRAPPERS = (SparseMLP, SparseAttention, InputSparseAttention, InputSparseMLP)  # each holds `original`
HEADS_PREFIX = "heads."  # a head predictor's tensors: "{layer}.heads.{name}"


@torch.no_grad()
def collect_stats(
    model: nn.Module, calibration: torch.Tensor, max_tokens: int = 2048, lookahead: bool = False
) -> list[LayerStats]:
    """act(gate(x)) and h = act(gate) * up of every MLP for the calibration samples' first
    `max_tokens` tokens (kept in fp16: 2048 tokens of SmolLM2 take 380 MB); with `lookahead`, each
    layer's stats also hold the previous layer's MLP inputs."""
    layers = decoder_layers(model)
    stats: list[list[LayerStats]] = [[] for _ in layers]

    def hook(index):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            gate_act, hidden = mlp_activations(mlp_parts(module), x)
            stats[index].append(LayerStats(x.half(), gate_act.half(), hidden.half()))

        return record

    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    _run_hooked(model, calibration, max_tokens, handles)
    merged = [
        LayerStats(*(torch.cat([getattr(s, name) for s in per]) for name in ("inputs", "gate_act", "hidden")))
        for per in stats
    ]
    for before, after in zip(merged, merged[1:], strict=False):
        after.previous = before.inputs if lookahead else None
    return merged


@torch.no_grad()
def collect_head_stats(
    model: nn.Module, calibration: torch.Tensor, max_tokens: int = 2048
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the attention inputs [t, hidden] (fp16) and each head's output norm [t, heads]
    for the calibration samples' first `max_tokens` tokens."""
    layers = decoder_layers(model)
    heads = model.config.num_attention_heads
    inputs: list[list[torch.Tensor]] = [[] for _ in layers]
    norms: list[list[torch.Tensor]] = [[] for _ in layers]

    def record_input(index):
        def hook(module, args, kwargs):
            inputs[index].append(_attention_input(args, kwargs).half())

        return hook

    def record_norms(index):
        def hook(module, args):
            norms[index].append(head_part_norms(module, args[0].reshape(-1, args[0].shape[-1]), heads))

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.self_attn.register_forward_pre_hook(record_input(i), with_kwargs=True))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(record_norms(i)))
    _run_hooked(model, calibration, max_tokens, handles)
    return [(torch.cat(x), torch.cat(n)) for x, n in zip(inputs, norms, strict=True)]


def _run_hooked(model: nn.Module, calibration: torch.Tensor, max_tokens: int, handles: list) -> None:
    """Run the calibration samples' first `max_tokens` tokens through `model`, then remove the hooks."""
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


def _attention_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden states an attention module's forward pre-hook sees, as rows [t, hidden]."""
    x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
    return x.reshape(-1, x.shape[-1])


def sparsify(
    model: nn.Module,
    selector: str,
    sparsity: float,
    calibration: torch.Tensor | None = None,
    dense_layers: int = 0,
    progress: bool = True,
    head_sparsity: float = 0.0,
    lookahead: bool = False,
    engine: str = "gather",
    **settings,
) -> list[Selector]:
    """Swap every decoder MLP (after the first `dense_layers`) for a `SparseMLP` whose selector was
    calibrated on `calibration` ids [n, seqlen]; returns the selectors (None for dense layers).
    With `head_sparsity` > 0 the same layers' attention becomes a `SparseAttention` whose head
    predictor is trained on the same text. `lookahead` also trains predictors on the previous
    layer's input, to report their recall (twice the training time). Further keywords are the
    selector's settings (e.g. the predictor's `rank`), saved with it by `save_selectors`. `engine`
    is how the sparse MLPs run a decode step on a CPU (`contextual.fused.ENGINES`)."""
    if checked_sparsity(head_sparsity, "head sparsity") and calibration is None:
        raise SparsegenError("head sparsity needs calibration text to train its predictors")
    densify(model)
    layers = decoder_layers(model)
    for layer in layers:
        mlp_parts(layer.mlp)
    selectors = [
        make_selector(selector, sparsity, **settings) if i >= dense_layers else None for i in range(len(layers))
    ]
    calibrates = type(selectors[-1]).calibrate is not Selector.calibrate
    stats = collect_stats(model, calibration, lookahead=lookahead) if calibration is not None and calibrates else None
    if stats is not None:
        bar = tqdm(stats, desc=f"calibrating {selector} {sparsity:.0%}", disable=not progress)
        for layer_stats, chosen in zip(bar, selectors, strict=True):
            if chosen is not None:
                chosen.calibrate(layer_stats)
    del stats
    heads = train_heads(model, calibration, head_sparsity, dense_layers, progress, lookahead) if head_sparsity else None
    install(model, selectors, heads, engine)
    return selectors


def train_heads(
    model: nn.Module,
    calibration: torch.Tensor,
    sparsity: float,
    dense_layers: int = 0,
    progress: bool = True,
    lookahead: bool = False,
) -> list[HeadPredictor | None]:
    """A head predictor per decoder layer after the first `dense_layers`, trained on `calibration`
    (and, with `lookahead`, one on the previous layer's input whose recall it reports)."""
    predictors = [HeadPredictor(sparsity) if i >= dense_layers else None for i in range(len(decoder_layers(model)))]
    stats = collect_head_stats(model, calibration)
    bar = tqdm(list(zip(stats, predictors, strict=True)), desc=f"training head predictors {sparsity:.0%}",
               disable=not progress)  # fmt: skip
    for index, ((inputs, norms), predictor) in enumerate(bar):
        if predictor is not None:
            predictor.calibrate(inputs, norms, stats[index - 1][0] if index and lookahead else None)
    return predictors


def install(
    model: nn.Module,
    selectors: list[Selector | None],
    heads: list[HeadPredictor | None] | None = None,
    engine: str = "gather",
) -> None:
    """Put each selector (and head predictor) into its decoder layer (None: that part stays dense);
    the sparse MLPs run `engine` (`contextual.fused.ENGINES`; a layer the fused kernel cannot take
    gathers, and says why)."""
    engine_format(engine, torch.float32)  # a bad name fails before anything changes
    densify(model)
    layers = decoder_layers(model)
    for layer, selector, predictor in zip(layers, selectors, heads or [None] * len(layers), strict=True):
        if selector is not None:
            selector.install(layer)
        if predictor is not None:
            layer.self_attn = SparseAttention(layer.self_attn, predictor)
    if engine != "gather":
        fuse(model, engine)


def installed_selectors(model: nn.Module) -> list[Selector | None]:
    return [getattr(layer.mlp, "selector", None) for layer in decoder_layers(model)]


def installed_heads(model: nn.Module) -> list[HeadPredictor | None]:
    return [getattr(layer.self_attn, "predictor", None) for layer in decoder_layers(model)]


@dataclass
class KeptShares:
    """Per decoder layer, the mean share of MLP neurons and of attention heads a step computes."""

    neurons: list[float]
    heads: list[float]

    @property
    def mean_neurons(self) -> float:
        return sum(self.neurons) / len(self.neurons)

    @property
    def mean_heads(self) -> float:
        return sum(self.heads) / len(self.heads)


@torch.no_grad()
def layer_kept_shares(model: nn.Module, ids: torch.Tensor) -> KeptShares:
    """Per decoder layer, the mean share of MLP neurons and attention heads a step over `ids` [b, n]
    computes (dense parts: all); the b rows of one step share the union of their sets. Measured,
    not the target."""
    layers = decoder_layers(model)
    shares = KeptShares([1.0] * len(layers), [1.0] * len(layers))

    def union_share(keep: torch.Tensor) -> float:
        return keep.view(*ids.shape, -1).any(0).float().mean().item()

    def neurons(index, selector):
        def record(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            gate_act, hidden = mlp_activations(mlp_parts(_dense(module)), x)
            shares.neurons[index] = union_share(selector.keep(x, gate_act, hidden))

        return record

    def heads(index):
        def record(module, args, kwargs):
            shares.heads[index] = union_share(module.predictor.keep(_attention_input(args, kwargs)))

        return record

    handles = [
        layer.mlp.register_forward_pre_hook(neurons(i, selector))
        for i, (layer, selector) in enumerate(zip(layers, installed_selectors(model), strict=True))
        if selector is not None
    ]
    handles += [
        layer.self_attn.register_forward_pre_hook(heads(i), with_kwargs=True)
        for i, layer in enumerate(layers)
        if isinstance(layer.self_attn, SparseAttention)
    ]
    try:
        model(ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return shares


def read_bytes(model: nn.Module, ids: torch.Tensor, shares: KeptShares | None = None) -> tuple[float, float]:
    """Bytes of decoder-layer weights one decode step of the rows `ids` [b, n] reads, and of all of
    them: a SparseMLP reads its kept neurons' rows (and the whole gate if its selector needs it), a
    SparseAttention its kept heads' query rows and output columns, an InputSparseLinear its kept
    inputs' rows at one row (all of them for more), anything else all. `shares` are
    `layer_kept_shares(model, ids)` when the caller has them already."""
    shares = layer_kept_shares(model, ids) if shares is None else shares
    read = total = 0.0

    def count(weight: torch.Tensor, share: float) -> None:
        nonlocal read, total
        size = weight.numel() * weight.element_size()
        read, total = read + size * share, total + size

    for layer, share, head_share in zip(decoder_layers(model), shares.neurons, shares.heads, strict=True):
        wrappers = [m for m in layer.modules() if isinstance(m, SPARSE_WRAPPERS)]
        inside = {id(m) for wrapper in wrappers for m in wrapper.original.modules()}  # counted by the wrapper
        for module in layer.modules():
            if isinstance(module, SparseMLP):
                for name, linear in (("gate", module.parts.gate), ("up", module.parts.up), ("down", module.parts.down)):
                    if linear is not None:
                        whole = module.selector.needs_hidden or name == "gate" and module.selector.needs_gate
                        count(linear.weight, 1.0 if whole else share)
            elif isinstance(module, SparseAttention):
                for name, part in module.read_share(head_share, ids.shape[0]).items():
                    count(getattr(module.original, name).weight, part)
            elif isinstance(module, InputSparseLinear):
                count(module.weight_t, module.read_share if ids.shape[0] == 1 else 1.0)
            elif isinstance(module, nn.Linear) and id(module) not in inside:
                count(module.weight, 1.0)
    return read, total


def densify(model: nn.Module) -> None:
    """Put the original MLPs and attention modules back."""
    for layer in decoder_layers(model):
        layer.self_attn = _dense(layer.self_attn)
        layer.mlp = _dense(layer.mlp)


def _dense(module: nn.Module) -> nn.Module:
    """The module a sparse wrapper replaced (the module itself when it is not one)."""
    return module.original if isinstance(module, SPARSE_WRAPPERS) else module


def _shape(model: nn.Module) -> dict:
    layers = decoder_layers(model)
    return {
        "layers": len(layers),
        "hidden": model.config.hidden_size,
        "neurons": mlp_parts(_dense(layers[0].mlp)).neurons,
        "heads": model.config.num_attention_heads,
    }


def save_selectors(
    model: nn.Module, selectors: list[Selector | None], folder: str | Path, selector: str, sparsity: float
):
    """Write the selectors' settings, and the head predictors installed in `model`, next to a model
    (`folder`/contextual.safetensors)."""
    heads = installed_heads(model)
    tensors = {
        f"{i}.{prefix}{name}": value.contiguous()
        for prefix, parts in (("", selectors), (HEADS_PREFIX, heads))
        for i, part in enumerate(parts)
        if part is not None
        for name, value in part.state().items()
    }
    chosen = next((s for s in selectors if s is not None), None)
    meta = {
        "selector": selector,
        "sparsity": str(sparsity),
        "settings": json.dumps(settings_of(chosen) if chosen is not None else {}),
        "shape": json.dumps(_shape(model)),
        "sparse_layers": json.dumps([i for i, s in enumerate(selectors) if s is not None]),
        "head_layers": json.dumps([i for i, h in enumerate(heads) if h is not None]),
        "head_sparsity": str(next((h.sparsity for h in heads if h is not None), 0.0)),
    }
    path = Path(folder) / SELECTORS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.replace(path)
    return path


def load_selectors(model: nn.Module, folder: str | Path, engine: str = "gather") -> list[Selector | None]:
    """Install the selectors saved in `folder` into `model` (its MLPs become sparse, run by `engine`)."""
    from safetensors import safe_open

    path = Path(folder) / SELECTORS_FILE
    if not path.is_file():
        raise SparsegenError(f"no {SELECTORS_FILE} in {folder}: make one with `sparsegen contextual train`")
    try:
        with safe_open(str(path), "pt") as handle:
            meta = handle.metadata()
        tensors = load_file(str(path), device=str(model_device(model)))
    except SafetensorError as exc:
        raise SparsegenError(f"{path} is truncated or corrupt ({exc}); train the selectors again") from None
    saved, here = json.loads(meta["shape"]), _shape(model)
    if saved != {key: here[key] for key in saved}:  # files from before head predictors lack "heads"
        raise SparsegenError(
            f"{path} was made for another model ({saved}), not this one ({here}): train selectors for this model"
        )

    def state(i: int, prefix: str) -> dict[str, torch.Tensor]:
        start = f"{i}.{prefix}"
        return {
            key[len(start) :]: value
            for key, value in tensors.items()
            if key.startswith(start) and (prefix or not key[len(start) :].startswith(HEADS_PREFIX))
        }

    layers = len(decoder_layers(model))
    selectors: list[Selector | None] = [None] * layers
    for i in json.loads(meta["sparse_layers"]):
        settings = json.loads(meta.get("settings", "{}"))  # files from before settings were recorded lack it
        selectors[i] = make_selector(meta["selector"], **{"sparsity": float(meta["sparsity"]), **settings})
        selectors[i].load_state(state(i, ""))
    heads: list[HeadPredictor | None] = [None] * layers
    for i in json.loads(meta.get("head_layers", "[]")):
        heads[i] = HeadPredictor(float(meta["head_sparsity"]))
        heads[i].load_state(state(i, HEADS_PREFIX))
    install(model, selectors, heads, engine)
    return selectors
