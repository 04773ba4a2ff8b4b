"""Generate behind a soft prompt whose KV is computed once and reused by every request.

The prompt's keys and values are read into a policy cache once; each request starts from a copy
of that state (`PolicyCache.load_state_dict`), so the k virtual tokens are never re-run. They are
pinned: no KV policy evicts them, and they come on top of its budget.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from sparsegen.kv import make_cache
from sparsegen.kv.cache import PolicyCache
from sparsegen.prompt.soft import SoftPrompt


class PromptedModel:
    """A model with a soft prompt read once into a KV cache under `policy` and its budget."""

    def __init__(self, model: nn.Module, prompt: SoftPrompt, policy: str = "full", **cache_options) -> None:
        prompt.check_fits(model)
        self.model, self.prompt, self.policy, self.cache_options = model, prompt, policy, cache_options
        cache = self._empty_cache()
        with torch.no_grad():
            embeds = prompt.embeddings.to(model.dtype)[None]
            model(inputs_embeds=embeds, past_key_values=cache, use_cache=True)
        self._prefix_state = cache.state_dict()

    def _empty_cache(self) -> PolicyCache:
        return make_cache(self.model, self.policy, pinned=self.prompt.tokens, **self.cache_options)

    def cache(self) -> PolicyCache:
        """A fresh cache holding the prompt's KV (a copy; the stored prefix is never changed)."""
        cache = self._empty_cache()
        cache.load_state_dict(copy.deepcopy(self._prefix_state))
        return cache

    def generate(self, input_ids: torch.Tensor, **generate_kwargs) -> torch.Tensor:
        """`model.generate` after the soft prompt; returns the ids of the text and what was generated.

        `input_ids` [1, n]: the cached prompt stands in front as k placeholder ids, which
        `generate()` skips because the cache already holds their positions.
        """
        k = self.prompt.tokens
        placeholder = torch.full((input_ids.shape[0], k), 0, dtype=input_ids.dtype, device=input_ids.device)
        ids = torch.cat([placeholder, input_ids], dim=1)
        output = self.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=self.cache(), **generate_kwargs
        )
        return output[:, k:]
