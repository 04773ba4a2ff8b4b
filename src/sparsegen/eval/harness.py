"""sparsegen models inside EleutherAI's lm-evaluation-harness, registered as `model="sparsegen"`.

Importing this module registers the model class, after which

    lm_eval.simple_evaluate(model="sparsegen", model_args="model=DIR,policy=h2o,budget=0.2", ...)

scores a dense model, a pruned checkpoint (dense or `--compressed`) or a KV policy. Without a
policy (or with `policy=full`) scoring is lm-eval's own transformers path, batched. With a policy,
each request is scored the way that policy would decode it: the context except its last token is
read (in `chunk`-token pieces if given, else in one pass) into a policy cache, which evicts down to
its budget; then the last context token and the continuation are read in one step over the
compressed cache, so every scored token is predicted from what the policy kept, never from a dense
pass. Budgets that are floats are shares of each request's context (H2O's "20% cache").
"""

from __future__ import annotations

import sys

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from tqdm.auto import tqdm

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import resolve_budget
from sparsegen.kv.spec import KVSpec


@register_model("sparsegen")
class SparsegenLM(HFLM):
    """An lm-eval model over `sparsegen.load()`, optionally decoding through a KV policy.

    `model`: an embedded name, a model folder or a pruned checkpoint. `policy`: a KV policy name
    (`full` = no eviction); `budget` (total) or `sinks`/`heavy`/`recent` (parts), each an int count
    or a float share of the request's context. `chunk`: read the context this many tokens at a time.
    `prompt`: a soft prompt folder read before every request (full cache only). From Python, a
    ready `(model, tokenizer)` can be passed as `loaded` and a `SoftPrompt` as `soft_prompt`.
    """

    def __init__(
        self,
        model: str = "smollm2-135m",
        policy: str = "full",
        budget: int | float | None = None,
        sinks: int | None = None,
        heavy: int | float | None = None,
        recent: int | float | None = None,
        position: str | None = None,
        chunk: int | None = None,
        dtype: str | None = None,
        batch_size: int | str = 1,
        prompt: str | None = None,
        loaded: tuple | None = None,
        soft_prompt=None,
        **kwargs,
    ) -> None:
        from sparsegen.loading import load
        from sparsegen.models import dtype_named

        if chunk is not None and chunk < 1:
            raise SparsegenError(f"chunk must be >= 1, got {chunk}")
        parts = {k: v for k, v in (("sinks", sinks), ("heavy", heavy), ("recent", recent)) if v is not None}
        self.kv = KVSpec.of(policy, budget=budget, position=position, **parts)  # bad settings fail now, as one line
        if loaded is None:
            loaded = load(model, dtype=dtype_named(dtype) if dtype else None, device=kwargs.get("device"))
        network, tokenizer = loaded
        if prompt is not None:
            from sparsegen.prompt import SoftPrompt

            soft_prompt = SoftPrompt.load(prompt, network)
        if soft_prompt is not None and policy != "full":
            raise SparsegenError("zero-shot scoring with a soft prompt runs on the full cache; drop the KV policy")
        self.soft_prompt, self.prompt = soft_prompt, prompt
        for option in ("device", "max_batch_size"):
            kwargs.pop(option, None)  # lm-eval passes these; the device placed the model above
        self.policy = policy
        self.budget = budget
        self.parts = parts
        self.position = position
        self.chunk = chunk
        # A policy cache scores one request at a time (each has its own budget), so no padding.
        super().__init__(
            pretrained=network,
            tokenizer=tokenizer,
            batch_size=1 if self.uses_policy else batch_size,
            **kwargs,
        )

    said_sinks_lowered = False

    @classmethod
    def over(cls, loaded: tuple, kv: KVSpec, **options) -> SparsegenLM:
        """A model scoring each request through the built spec `kv`: its budget parts (counts, or
        shares each resolved against the request's context) and position; KV in full precision."""
        if kv.kv_bits is not None:
            raise SparsegenError("zero-shot scoring holds the KV in full precision; drop kv_bits")
        parts = {part: getattr(kv.policy, part) for part in kv.policy.budget_parts()}
        return cls(loaded=loaded, policy=kv.name, position=kv.position, **parts, **options)

    @property
    def uses_policy(self) -> bool:
        return self.policy != "full"

    def settings(self) -> dict:
        """What this model scores with, recorded beside its results (`kv`: `KVSpec.from_dict` reads it)."""
        return {
            "policy": self.policy,
            "budget": self.budget,
            **self.parts,
            "position": self.position,
            "kv": self.kv.to_dict(),
            "chunk": self.chunk,
            **({"prompt": self.prompt or f"{self.soft_prompt.tokens} virtual tokens"} if self.soft_prompt else {}),
        }

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """Logits of `inps` (right-padded rows), read after the soft prompt when there is one."""
        if self.soft_prompt is None:
            return super()._model_call(inps, attn_mask, labels)
        with torch.no_grad():
            embeds = self.soft_prompt.prepend(self.model.get_input_embeddings()(inps))
            return self.model(inputs_embeds=embeds).logits[:, self.soft_prompt.tokens :]

    def _make_cache(self, context_length: int):
        from sparsegen.kv import make_cache

        counts = resolve_budget(self.policy, context_length, self.budget, self.parts)
        asked = self.parts.get("sinks")
        if asked is not None and counts.get("sinks", asked) < asked and not self.said_sinks_lowered:
            self.said_sinks_lowered = True  # once: the rule follows from the recorded budget and sinks
            print(
                f"sinks lowered to {counts['sinks']} for a {context_length}-token request (sinks are at most half "
                f"a request's budget); longer requests keep {asked}",
                file=sys.stderr,
            )
        return make_cache(self.model, KVSpec.of(self.policy, position=self.position, **counts))

    @torch.inference_mode()
    def policy_logits(self, tokens: list[int], read: int) -> torch.Tensor:
        """Logits [n - read, vocab] of `tokens[read:]`, after `tokens[:read]` went through a policy cache."""
        from sparsegen.decode.reading import read as read_into

        cache = self._make_cache(max(read, 1))
        read_into(self.model, tokens[:read], cache, self.chunk)
        return read_into(self.model, tokens[read:], cache, all_logits=True)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if not self.uses_policy:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        results = []
        for request, context_enc, continuation_enc in tqdm(
            requests, disable=disable_tqdm or self.rank != 0, desc=f"Scoring through {self.policy}"
        ):
            tokens = (context_enc + continuation_enc)[-(self.max_length + 1) :]
            inputs = tokens[:-1]
            context_length = len(tokens) - len(continuation_enc)
            logits = self.policy_logits(inputs, read=context_length - 1)
            logprobs = logits[-len(continuation_enc) :].log_softmax(-1)
            target = torch.tensor(continuation_enc, device=logprobs.device)
            answer = (
                float(logprobs.gather(1, target[:, None]).sum()),
                bool((logprobs.argmax(-1) == target).all()),
            )
            results.append(answer)
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        if not self.uses_policy:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        from sparsegen.kv.attention import policy_attention

        with policy_attention(self.model):  # the model's own attention again after the request
            generation_kwargs["cache"] = self._make_cache(context.shape[1])
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
