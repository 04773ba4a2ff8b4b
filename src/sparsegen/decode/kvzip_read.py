"""KVzip's re-read of a context (`kv.kvzip`): the model reads the context again after itself, chunk
by chunk, and each recording layer keeps the most attention each context token received. The
policy scores with those peaks; running the model for them is decode's work, so it lives here,
beside `decode.shared.SharedPrefill`, which runs it once per context for every budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparsegen.kv.attention import policy_attention
from sparsegen.kv.kvzip import OutputNorms, Probe
from sparsegen.kv.policy_cache import PolicyCache, layer_state, load_layer_state
from sparsegen.models import decoder_layers

FIRST_ASK = "\n\nRepeat the context above word for word."
LATER_ASK = "\n\nRepeat the part of the context above word for word, from the words: "
BARE_TURN = "\n\n"
"""Where the model's answer starts without a chat template."""


@dataclass(frozen=True)
class RepeatFrame:
    """The words around each re-read chunk when the model is asked to repeat the context (as the
    paper re-reads it): `first` before the first chunk; `later` before a later one, whose cue
    follows it; `turn` (the chat template's close of the user turn and the assistant's start)
    before the chunk itself."""

    first: tuple[int, ...]
    later: tuple[int, ...]
    turn: tuple[int, ...]

    def around(self, rows: torch.Tensor, probe: Probe) -> torch.Tensor:
        """The re-read input [b, m] of `probe` over the context `rows` [b, n]."""
        ask = self.first if probe.start == 0 else self.later

        def words(ids):
            return torch.tensor(ids, dtype=rows.dtype, device=rows.device).expand(rows.shape[0], -1)

        parts = [words(ask), rows[:, probe.first : probe.start], words(self.turn), rows[:, probe.start : probe.stop]]
        return torch.cat(parts, dim=1)


def repeat_frame(tokenizer) -> RepeatFrame:
    """The frame for `tokenizer`'s model: the asks continue the context's user turn, which its chat
    template then closes and opens the answer with (a base model's answer starts after a blank line)."""

    def ids(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    turn = BARE_TURN
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00MARK\x00"
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": marker}], add_generation_prompt=True, tokenize=False
        )
        turn = rendered[rendered.index(marker) + len(marker) :]
    return RepeatFrame(ids(FIRST_ASK), ids(LATER_ASK), ids(turn))


@torch.inference_mode()
def reconstruct(
    model: torch.nn.Module,
    record: PolicyCache,
    rows: torch.Tensor,
    probes: tuple[Probe, ...],
    frame: RepeatFrame | None = None,
    output_norms: bool = False,
) -> list[torch.Tensor | None]:
    """Per layer of `record` (the `full` cache of `decode.shared.SharedPrefill` that has just read
    `rows` [b, n]): the most attention each context token received, over its group's queries, while
    the model re-read its chunk after the context, bare or inside `frame` ([b, h, n] float32; None for
    a layer without a policy; weighed as KVzip+ weighs them with `output_norms`: `hand_output_norms`).
    Each recording layer computes its re-reading's attention itself (`probing`), leaving the peaks
    in its `peak`. `record` holds the context alone again afterwards, its recorded calls those of the
    context."""
    layers = record.layers
    calls = [getattr(layer, "recorded", None) for layer in layers]
    saved = [layer_state(layer) for layer in layers]
    b, n = rows.shape
    peaks = [
        None if call is None else call.keys.new_zeros(b, call.keys.shape[1], n, dtype=torch.float32) for call in calls
    ]
    probing = [(layer, call) for layer, call in zip(layers, calls, strict=True) if call is not None]
    hooks: list = []
    try:
        if output_norms:
            hand_output_norms(model, [layer for layer, _ in probing], hooks)
        with policy_attention(model):
            for probe in probes:
                for layer, _ in probing:
                    layer.probing = probe
                read_again = rows[:, probe.first : probe.stop] if frame is None else frame.around(rows, probe)
                model(input_ids=read_again, cache=record, use_cache=True, logits_to_keep=1)
                for layer, peak in zip(layers, peaks, strict=True):
                    if peak is not None:
                        peak[..., probe.start : probe.stop] = layer.peak[..., probe.start : probe.stop]
                for layer, state in zip(layers, saved, strict=True):
                    load_layer_state(layer, state)
    finally:
        for hook in hooks:
            hook.remove()
        for layer, call in probing:
            layer.probing, layer.peak, layer.recorded, layer.output_norms = None, None, call, None
    return peaks


def hand_output_norms(model: torch.nn.Module, layers: list, handles: list) -> None:
    """KVzip+: a hook on each of `layers`' attention modules that, before every call, hands the
    recording layer its `OutputNorms` (its output projection's per-head Gram, the norms of the hidden
    states the call reads). Each hook's handle goes into `handles` as it is made, for the caller to remove."""
    blocks = decoder_layers(model)
    for layer in layers:
        attention = blocks[layer.layer_idx].self_attn
        gram = head_grams(attention.o_proj, attention.head_dim, attention.config.num_key_value_heads)

        def hand(module, args, kwargs, layer=layer, gram=gram):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            layer.output_norms = OutputNorms(gram, hidden.float().norm(dim=-1))

        handles.append(attention.register_forward_pre_hook(hand, with_kwargs=True))


def head_grams(o_proj: torch.nn.Module, head_dim: int, kv_heads: int) -> torch.Tensor:
    """W_j^T W_j [kv_heads, group, d, d] of each query head j's columns of `o_proj` (a Linear, or a
    quantized layer whose `weight()` decodes its blocks), in float32."""
    weight = o_proj.weight if isinstance(o_proj.weight, torch.Tensor) else o_proj.weight()
    per_head = weight.float().view(weight.shape[0], -1, head_dim)  # [out, heads, d]
    gram = torch.einsum("ojd,oje->jde", per_head, per_head)
    return gram.view(kv_heads, -1, head_dim, head_dim)
