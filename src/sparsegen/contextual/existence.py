"""Does contextual sparsity exist (Deja Vu's first experiment)? Per layer, on real text: how many MLP
neurons and attention heads a token needs for the block's output to stay within a relative error,
what a static choice of the same size costs, and how slowly the residual stream changes.

A block's output is a sum of parts: neuron i adds h_i * W_down[:, i], head j adds W_o[:, j] a_j.
Each token's parts are ranked by their output norm and the smallest prefix whose sum is within
`tolerance` of the whole is what the token needs. The static choice is, per layer, the same number
of parts for every token: those with the largest mean output norm.
"""

from __future__ import annotations

import torch
from torch import nn

from sparsegen.contextual.parts import mlp_activations, mlp_parts
from sparsegen.models import decoder_layers


def _needed(parts: torch.Tensor, tolerance: float) -> torch.Tensor:
    """parts [t, n, d] -> the number of largest parts each token needs so that their sum is within
    `tolerance` (relative L2) of the sum of all."""
    order = parts.norm(dim=-1).argsort(dim=-1, descending=True)
    ranked = parts.gather(1, order[..., None].expand_as(parts))
    whole = parts.sum(1, keepdim=True)
    error = (whole - ranked.cumsum(1)).norm(dim=-1) / whole.norm(dim=-1).clamp_min(1e-12)
    return (error > tolerance).sum(1) + 1


def _static_error(parts: torch.Tensor, size: int) -> float:
    """Mean relative error of the `size` parts with the largest mean output norm, for every token."""
    kept = parts.norm(dim=-1).mean(0).topk(size).indices
    whole = parts.sum(1)
    return ((whole - parts[:, kept].sum(1)).norm(dim=-1) / whole.norm(dim=-1).clamp_min(1e-12)).mean().item()


def _block_parts(parts, down, per_head, mlp_in, attended) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's parts of the MLP output [t, neurons, hidden] and of the attention output
    [t, heads, hidden], from the MLP inputs [t, hidden] and o_proj's inputs [t, heads, head_dim]."""
    hidden = mlp_activations(parts, mlp_in.to(parts.up.weight.dtype))[1].float()
    return hidden[..., None] * down, torch.einsum("thd,hdo->tho", attended, per_head)


@torch.no_grad()
def measure_existence(model: nn.Module, ids: torch.Tensor, tolerance: float = 0.1, chunk: int = 16) -> list[dict]:
    """One row per decoder layer over the tokens `ids` [1, n]: the mean share of neurons and heads a
    token needs (within `tolerance`), the static choice's error at that size, and the cosine
    similarity between this layer's input and the next one's."""
    layers = decoder_layers(model)
    inputs: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(len(layers))}

    def keep(index: int, key: str):
        def hook(module, args):
            inputs[index][key] = args[0].reshape(-1, args[0].shape[-1]).float()

        return hook

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.mlp.register_forward_pre_hook(keep(i, "mlp")))
        handles.append(layer.self_attn.o_proj.register_forward_pre_hook(keep(i, "heads")))
    try:
        states = model(ids, use_cache=False, output_hidden_states=True).hidden_states
    finally:
        for handle in handles:
            handle.remove()
    rows = []
    heads = model.config.num_attention_heads
    for i, layer in enumerate(layers):
        parts = mlp_parts(layer.mlp)
        down = parts.down.weight.float().t()  # [neurons, hidden]
        o_weight = layer.self_attn.o_proj.weight.float()  # [hidden, heads * head_dim]
        per_head = o_weight.view(o_weight.shape[0], heads, -1).permute(1, 2, 0)  # [heads, head_dim, hidden]
        needed_neurons, needed_heads = [], []
        mlp_in, attended = inputs[i]["mlp"], inputs[i]["heads"].view(inputs[i]["mlp"].shape[0], heads, -1)
        for start in range(0, mlp_in.shape[0], chunk):
            piece = slice(start, start + chunk)
            neuron_parts, head_parts = _block_parts(parts, down, per_head, mlp_in[piece], attended[piece])
            needed_neurons.append(_needed(neuron_parts, tolerance))
            needed_heads.append(_needed(head_parts, tolerance))
        neurons, head_counts = torch.cat(needed_neurons).float(), torch.cat(needed_heads).float()
        sample = slice(0, 64)  # the static error over a sample of tokens (all parts of 512 would take 1.8 GB)
        all_neurons, all_heads = _block_parts(parts, down, per_head, mlp_in[sample], attended[sample])
        cosine = None
        if i + 1 < len(layers):  # the last hidden state is after the final norm: no next layer's input
            cosine = torch.nn.functional.cosine_similarity(states[i][0].float(), states[i + 1][0].float(), dim=-1)
        rows.append({
            "layer": i,
            "neurons_needed": neurons.mean().item() / parts.neurons,
            "static_neuron_error": _static_error(all_neurons, max(1, round(neurons.mean().item()))),
            "heads_needed": head_counts.mean().item() / heads,
            "static_head_error": _static_error(all_heads, max(1, round(head_counts.mean().item()))),
            "residual_cosine": None if cosine is None else cosine.mean().item(),
        })  # fmt: skip
    return rows
