"""KVzip's re-read of a context (`kv.kvzip`): the model reads the context again after itself, chunk
by chunk, and each recording layer keeps the most attention each context token received. The
policy scores with those peaks; running the model for them is decode's work, so it lives here,
beside `decode.shared.SharedPrefill`, which runs it once per context for every budget.
"""

from __future__ import annotations

import torch

from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy_cache import PolicyCache, layer_state, load_layer_state


@torch.inference_mode()
def reconstruct(
    model: torch.nn.Module, record: PolicyCache, rows: torch.Tensor, probes: tuple[tuple[int, int, int], ...]
) -> list[torch.Tensor | None]:
    """Per layer of `record` (the `full` cache of `decode.shared.SharedPrefill` that has just read
    `rows` [b, n]): the most attention each context token received, over its group's queries, while
    the model re-read its chunk after the context ([b, h, n] float32; None for a layer without a policy). Each
    recording layer computes its re-reading's attention itself (`probing`), leaving the peaks in
    its `peak`. `record` holds the context alone again afterwards, its recorded calls those of the
    context."""
    layers = record.layers
    calls = [getattr(layer, "recorded", None) for layer in layers]
    saved = [layer_state(layer) for layer in layers]
    b, n = rows.shape
    peaks = [
        None if call is None else call.keys.new_zeros(b, call.keys.shape[1], n, dtype=torch.float32) for call in calls
    ]
    probing = [(layer, call) for layer, call in zip(layers, calls, strict=True) if call is not None]
    try:
        for layer, _ in probing:
            layer.probing = True
        with policy_attention(model):
            for first, start, stop in probes:
                model(input_ids=rows[:, first:stop], cache=record, use_cache=True, logits_to_keep=1)
                for layer, peak in zip(layers, peaks, strict=True):
                    if peak is not None:
                        peak[..., start:stop] = layer.peak[..., start:stop]
                for layer, state in zip(layers, saved, strict=True):
                    load_layer_state(layer, state)
    finally:
        for layer, call in probing:
            layer.probing, layer.peak, layer.recorded = False, None, call
    return peaks
