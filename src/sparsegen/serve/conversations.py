"""The conversations the server holds between requests.

The API is stateless, so after a chat answer the engine keeps the row's cache (handed back from
the batch) with the exact text it has read. A later request whose rendered prompt starts with that
text continues the cache and reads only the new part. Held caches count against the KV memory and
are dropped least recently used when a request needs the room; a dropped conversation that comes
back is rebuilt by reading its whole history under the policy. The engine calls every method under
its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from sparsegen.kv import PolicyCache


@dataclass
class Conversation:
    """A policy cache and the text it has read (a follow-up must start with it); `unfed` is the
    answer's last token, sampled but not yet read into the cache."""

    cache: PolicyCache
    text: str = ""
    unfed: list[int] = field(default_factory=list)
    nbytes: int = 0


class ConversationStore:
    """Held conversations, least recently kept first."""

    def __init__(self) -> None:
        self._held: OrderedDict[int, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._held)

    @property
    def nbytes(self) -> int:
        """KV bytes the held caches take."""
        return sum(conversation.nbytes for conversation in self._held.values())

    def keep(self, conversation: Conversation) -> None:
        self._held[id(conversation)] = conversation

    def drop_oldest(self) -> None:
        self._held.popitem(last=False)

    def continued_by(self, text: str) -> Conversation | None:
        """The held conversation `text` continues (the longest whose text it extends), still held."""
        matches = [c for c in self._held.values() if c.text and len(text) > len(c.text) and text.startswith(c.text)]
        return max(matches, key=lambda c: len(c.text), default=None)

    def take(self, conversation: Conversation) -> Conversation:
        """Claim a held conversation for a request: it is no longer held (its row holds it)."""
        del self._held[id(conversation)]
        return conversation
