"""Generate behind a soft prompt whose KV is computed once and reused by every request.

The prompt's keys and values are read into a policy cache once; each request starts from a copy
of that state (`PolicyCache.load_state_dict`), so the k virtual tokens are never re-run, and
decodes through the one token loop (`sparsegen.decode.generate` continuing that cache). They are
pinned: no KV policy evicts them, and they come on top of its budget.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.spec import KVSpec
from sparsegen.prompt.soft import SoftPrompt


class PromptedModel:
    """A model with a soft prompt read once into a KV cache under the KV spec `kv`."""

    def __init__(self, model: nn.Module, prompt: SoftPrompt, kv: KVSpec | str = "full") -> None:
        prompt.check_fits(model)
        self.model, self.prompt, self.kv = model, prompt, KVSpec.coerce(kv)
        cache = self._empty_cache()
        with torch.no_grad(), policy_attention(model):
            embeds = prompt.embeddings.to(model.dtype)[None]
            model(inputs_embeds=embeds, cache=cache, use_cache=True)
        self._prefix_state = cache.state_dict()

    def _empty_cache(self) -> PolicyCache:
        return make_cache(self.model, self.kv, pinned=self.prompt.tokens)

    def cache(self) -> PolicyCache:
        """A fresh cache holding the prompt's KV (a copy; the stored prefix is never changed)."""
        cache = self._empty_cache()
        cache.load_state_dict(copy.deepcopy(self._prefix_state))
        return cache

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 128, **options) -> torch.Tensor:
        """Generate after the soft prompt through sparsegen's token loop, continuing a copy of the
        prompt's cache; returns the ids of the text and what was generated [1, n + new].

        `options` go to `sparsegen.decode.generate` (temperature, top_p, seed, compile, ...).
        """
        from sparsegen.decode import generate

        cache = self.cache()
        made = generate(self.model, input_ids.tolist(), max_new_tokens, cache.spec, held=[cache], **options)
        return torch.cat([input_ids, torch.tensor(made.tokens, dtype=input_ids.dtype, device=input_ids.device)], dim=1)
