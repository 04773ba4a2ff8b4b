"""Building a transformers model around weights already in hand (a checkpoint's state, packed or
block layers), on the meta device, so no weight is ever allocated twice: what `loading`, the GGUF
loader and the from-disk reader share."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from sparsegen.errors import SparsegenError


def assemble(
    source, config, state: dict, layers: dict, dtype: torch.dtype, attn_implementation, away: str | None = None
) -> PreTrainedModel:
    """The model of `config` holding `state` and the given modules, built on the meta device so no
    weight is ever allocated twice (a packed model never holds its float weights). Weights whose
    names start with `away` stay on the meta device (read later, block by block)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    for name, module in layers.items():
        model.set_submodule(name, module)
    state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = {key for key in missing if key.rpartition(".")[0] not in layers and not (away and key.startswith(away))}
    missing -= tied
    if missing or unexpected:
        raise SparsegenError(
            f"{source}: the weights do not fit the config (missing {sorted(missing)[:3]}, "
            f"unexpected {sorted(unexpected)[:3]}); save the checkpoint again"
        )
    model.tie_weights()
    owners = {name.rpartition(".")[0] for name, buffer in model.named_buffers() if buffer.is_meta}
    for owner in map(model.get_submodule, owners):  # computed, not stored: rotary frequencies, scales
        for leaf, buffer in owner.named_buffers(recurse=False):
            if buffer.is_meta:
                persistent = leaf not in owner._non_persistent_buffers_set
                owner.register_buffer(leaf, torch.empty_like(buffer, device="cpu"), persistent=persistent)
        loaded = dict(owner._parameters)
        owner._parameters.update({k: nn.Parameter(p.to("meta"), False) for k, p in loaded.items() if p is not None})
        model._init_weights(owner)  # computes the buffers; would re-draw the loaded weights, held aside
        owner._parameters.update(loaded)
    return model
