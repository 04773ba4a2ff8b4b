"""A multi-round chat over one policy cache: the conversation never ends, memory stays bounded."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from sparsegen.kv.factory import make_cache
from sparsegen.kv.policy import Policy
from sparsegen.kv.stream import stream
from sparsegen.sampling import stop_tokens


class StreamingChat:
    """Feeds each new turn (only its new tokens) into the same cache and generates the answer.

    The chat template is rendered for the whole conversation and only the text past what was
    already fed is tokenised, so the cache holds exactly the conversation, minus evictions.
    """

    def __init__(
        self,
        model,
        tokenizer,
        policy: str | Policy = "streaming",
        position: str | None = None,
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        **budget: int | float,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.cache = make_cache(model, policy, position=position, **budget)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.messages: list[dict] = []
        self.fed_text = ""
        self.stop_ids = stop_tokens(model, tokenizer)

    def _render(self, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def ask(self, text: str) -> Iterator[str]:
        """Yield the answer to `text` piece by piece as tokens are generated."""
        self.messages.append({"role": "user", "content": text})
        rendered = self._render(add_generation_prompt=True)
        if rendered.startswith(self.fed_text):
            new_text = rendered[len(self.fed_text) :]
        else:  # a template that rewrites earlier turns: feed this turn on its own
            new_text = self.tokenizer.apply_chat_template(
                self.messages[-1:], tokenize=False, add_generation_prompt=True
            )
        ids = torch.tensor(self.tokenizer(new_text, add_special_tokens=False)["input_ids"])
        answer: list[int] = []
        shown = ""
        stopped = False
        for step in stream(
            self.model,
            ids,
            cache=self.cache,
            chunk=max(1, ids.numel()),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
        ):
            if not step.generated:
                continue
            token = int(step.tokens[0, 0])
            if token in self.stop_ids:
                stopped = True
                break
            answer.append(token)
            decoded = self.tokenizer.decode(answer, skip_special_tokens=True)
            yield decoded[len(shown) :]
            shown = decoded
        reply = self.tokenizer.decode(answer, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        self.fed_text = rendered + self.tokenizer.decode(answer)
        if stopped:
            self.fed_text += self.tokenizer.decode([token])
