"""Token ids read into a policy cache, a chunk per forward under sparsegen's attention: the loop
under every read. `decode.reading.read` runs it, and so does `decode.shared.SharedPrefill`'s one
read of a context, which `read` in turn uses for a policy that re-reads the prompt (`kv.kvzip`):
the loop lives below both.
"""

from __future__ import annotations

import torch

from sparsegen.fused_layers import fused_layers
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy_cache import PolicyCache


def token_rows(model: torch.nn.Module, ids: list[int] | torch.Tensor) -> torch.Tensor:
    """`ids` (one row's list, or rows [b, n]) as rows [b, n] on the model's device."""
    device = next(model.parameters()).device
    return ids.to(device) if isinstance(ids, torch.Tensor) else torch.tensor([ids], dtype=torch.long, device=device)


def read_rows(
    model: torch.nn.Module, rows: torch.Tensor, cache: PolicyCache, step: int, all_logits: bool
) -> torch.Tensor | None:
    """Read `rows` [b, n] into `cache`, `step` tokens per forward (the layers' norms and MLP
    activations fused: `fused_layers`). Returns the logits of every
    token [b, n, vocab] with `all_logits`, else of the last one [b, vocab]; None for no tokens."""
    kept = []
    with fused_layers(model), policy_attention(model):
        for start in range(0, rows.shape[1], step):
            piece = rows[:, start : start + step]
            logits = model(
                input_ids=piece, cache=cache, use_cache=True, logits_to_keep=0 if all_logits else 1
            ).logits.float()
            kept.append(logits if all_logits else logits[:, -1])
    if not kept:
        return None
    return torch.cat(kept, 1) if all_logits else kept[-1]


def as_given(out: torch.Tensor | None, ids: list[int] | torch.Tensor) -> torch.Tensor | None:
    """`out` shaped as `ids` came: rows for rows, one row's logits for one row's list."""
    return out if out is None or isinstance(ids, torch.Tensor) else out[0]
