"""A multi-round chat over one policy cache: the conversation never ends, memory stays bounded."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch

from sparsegen.decode.engine import Decoder
from sparsegen.decode.generate import token_loop
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.policy import Policy
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule, choose, stop_tokens


class StreamingChat:
    """Decodes each answer through the `Decoder` under the KV spec `kv`, continuing the
    conversation's held cache, as the server's conversations do: between turns `cache` holds the
    conversation, minus evictions.

    The chat template is rendered for the whole conversation and only the text past what was
    already read is tokenised; an answer's last token, sampled but not yet read, is read first
    at the next turn.
    """

    def __init__(
        self,
        model,
        tokenizer,
        kv: KVSpec | str | Policy = "streaming",
        max_new_tokens: int = 256,
        temperature: float = 0.0,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.decoder = Decoder(model, kv, compile="never")
        self.cache: PolicyCache | None = None  # the conversation read so far (none before the first turn)
        self.unfed: list[int] = []
        self.rule = StopRule(
            max_new_tokens,
            frozenset(stop_tokens(model, tokenizer)),
            decode=partial(tokenizer.decode, skip_special_tokens=True),
        )
        self.temperature = temperature
        self.messages: list[dict] = []
        self.fed_text = ""

    def _sample(self, logits: torch.Tensor, batch: list[int]) -> torch.Tensor:
        return choose(logits, self.temperature, 1.0, None)

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def ask(self, text: str) -> Iterator[str]:
        """Yield the answer to `text` piece by piece as tokens are generated."""
        self.messages.append({"role": "user", "content": text})
        rendered = self._render(self.messages)
        if rendered.startswith(self.fed_text):
            new_text = rendered[len(self.fed_text) :]
        else:  # a template that rewrites earlier turns: read this turn on its own
            new_text = self._render(self.messages[-1:])
        ids = self.unfed + self.tokenizer(new_text, add_special_tokens=False)["input_ids"]
        shown = ""
        with policy_attention(self.model):
            for progress in token_loop(self.decoder, [ids], [self.cache], self.rule, self._sample):
                text = progress.verdicts[0].text
                if len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text
            self.cache = self.decoder.hand_back(0)
            self.decoder.leave([0])  # the batch's buffers go; the conversation lives on in `cache`
        answer = progress.rows[0]
        self.messages.append({"role": "assistant", "content": progress.verdicts[0].text})
        self.fed_text = rendered + self.tokenizer.decode(answer)
        self.unfed = answer[-1:]
