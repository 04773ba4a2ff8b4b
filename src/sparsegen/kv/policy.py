"""What a KV-cache policy is: how its scores follow attention, and which cached tokens stay.

After every attention call the cache layer hands its policy a `Step`: everything that call knows
(the held tokens' positions, keys and values, the new queries' attention, the policy's running
scores, tokens seen, the budget). The policy returns its updated scores (`score`) and, when the
cache is over budget, a keep-priority per held token (`priority`); the layer keeps the highest.
Each policy is one file: a dataclass whose fields are its typed, documented settings, registered
by name, declaring the budget parts it takes and how a total budget splits among them.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from sparsegen.errors import SparsegenError
from sparsegen.kv.rope import KeyRotation
from sparsegen.registry import Registry

POLICIES = Registry("KV policy", "policy")
register_policy = POLICIES.register

KEEP = float("inf")
PARTS = ("sinks", "heavy", "recent")
DEFAULT_SINKS = 4
"""Initial tokens kept by a policy with sinks when its caller names none (StreamingLLM's 4)."""


@dataclass(frozen=True)
class Sizes:
    """Token counts of one resolved budget: never-evicted first tokens, top-scored, most recent.
    Ints for one cache; one count per row ([b, 1, 1] tensors) in the fast path's slots."""

    sinks: int | torch.Tensor = 0
    heavy: int | torch.Tensor = 0
    recent: int | torch.Tensor = 0

    @property
    def budget(self) -> int | torch.Tensor:
        return self.sinks + self.heavy + self.recent

    @property
    def largest(self) -> int:
        """The largest row's budget (the budget where rows share it)."""
        budget = self.budget
        return int(budget.max()) if isinstance(budget, torch.Tensor) else budget


@dataclass
class Step:
    """What one attention call knows, as the policy sees it (held tokens include the new ones).

    `positions`, `scores` [b, h, n]; `keys`, `values` [b, h, n, d] (keys as attention saw them;
    None where the fast path multiplies rounded slots as bytes, `kv.kernels`, which only policies
    that score from attention while decoding meet);
    `query` [b, hq, new, d], the new tokens' queries; `weights`, when the attention implementation
    returned them, [b, hq, new, n]. `seen` counts every token so far (per row, [b, 1, 1], on the
    fast path), `new` this call's. `rope` rotates by the model's RoPE frequencies (given by the
    drop-in cache, for policies that reason about queries at other positions); `layer` is the
    attention layer's index. `reconstruction` [b, h, n], for a policy that `reconstructs`, is the
    most attention each held token received while the model re-read the prompt (`kv.kvzip`).
    """

    positions: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scores: torch.Tensor
    query: torch.Tensor
    scaling: float
    seen: int | torch.Tensor
    new: int
    sizes: Sizes | None
    weights: torch.Tensor | None = None
    rope: KeyRotation | None = None
    layer: int = 0
    reconstruction: torch.Tensor | None = None
    _received: dict = field(default_factory=dict, repr=False)

    def received(self, last: int | None = None) -> torch.Tensor:
        """Attention each held key received from the newest `last` queries (default: all new ones),
        summed over those queries and over each GQA group: float32 [b, h, n]."""
        last = self.new if last is None else min(last, self.new)
        if last not in self._received:
            b, h = self.positions.shape[:2]
            if self.weights is not None:
                chosen = self.weights[:, :, -last:].float()
                self._received[last] = chosen.view(b, h, -1, *chosen.shape[-2:]).sum(dim=(2, 3))
            else:
                self._received[last] = attention_received(self.query[:, :, -last:], self.keys, self.scaling)
        return self._received[last]

    def queries_before_rope(self, sinks: int) -> torch.Tensor:
        """This call's queries turned back to before RoPE [b, hq, n, d] (float32), those of the first
        `sinks` positions left out of a prompt's (kept where nothing else is)."""
        b, hq, new, _ = self.query.shape
        first = torch.as_tensor(self.seen, device=self.query.device).view(-1, 1, 1) - new
        positions = (first + torch.arange(new, device=self.query.device)).expand(b, hq, new)
        queries = self.rope.rotate(self.query.float(), -positions)
        counted = positions[0, 0] >= sinks
        return queries[:, :, counted] if new > 1 and bool(counted.any()) else queries

    def is_sink(self) -> torch.Tensor:
        return self.positions < self.sizes.sinks

    def is_recent(self) -> torch.Tensor:
        return self.positions >= self.seen - self.sizes.recent


def attention_chunks(query: torch.Tensor, key: torch.Tensor, scaling: float, max_elements: int = 1 << 20):
    """The attention probabilities of new queries, a few queries at a time: yields (start, stop,
    seen, probabilities [b, hkv, group * (stop - start), seen] float32, rows group-major).

    query [b, hq, q, d] are the newest q tokens, key [b, hkv, s, d] the held keys followed by
    those q; causal among the new ones. Queries go in chunks so a long prefill never materialises
    the whole q x s matrix, each chunk against only the keys its queries see (half the work of a
    prefill); keys are never copied. Chunks of about a million scores stay in the CPU's cache
    through softmax and what follows (2.2x faster than 16 M at 2k x 6k); the scaling goes on the
    queries and the causal mask only on the chunk's own keys (0.32 -> 0.20 s for 1.8k queries over
    5.6k keys, the same numbers where the scaling is a power of two).
    """
    b, hq, q, d = query.shape
    hkv, s = key.shape[1], key.shape[2]
    group = hq // hkv
    grouped = query.view(b, hkv, group, q, d)
    keys_t = key.transpose(-1, -2)
    step = max(1, max_elements // max(1, b * hq * s))
    held = s - q
    for start in range(0, q, step):
        stop = min(q, start + step)
        seen = held + stop  # keys visible to this chunk's last query
        rows = grouped[:, :, :, start:stop].reshape(b, hkv, group * (stop - start), d)
        logits = ((rows * scaling) @ keys_t[..., :seen]).float()
        if stop - start > 1:  # causal among the chunk's own keys only: every query sees the keys before them
            new = torch.arange(start, stop, device=query.device)
            logits[..., held + start :].masked_fill_(new > new.repeat(group)[:, None], float("-inf"))
        yield start, stop, seen, logits.softmax(-1)


def attention_received(
    query: torch.Tensor, key: torch.Tensor, scaling: float, max_elements: int = 1 << 20, peak: bool = False
):
    """Attention probability each key received, summed over new queries and each GQA group (with
    `peak`, the largest any of them gave it): float32 [b, hkv, s] (shapes as `attention_chunks`)."""
    b, hkv, s = key.shape[:3]
    total = torch.zeros(b, hkv, s, dtype=torch.float32, device=query.device)
    for _, _, seen, probabilities in attention_chunks(query, key, scaling, max_elements):
        if peak:
            torch.maximum(total[..., :seen], probabilities.amax(dim=2), out=total[..., :seen])
        else:
            total[..., :seen] += probabilities.sum(dim=2)
    return total


def _check_count(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SparsegenError(f"{name} must be a number, got {value!r}")
    if value < 0:
        raise SparsegenError(f"{name} must be >= 0, got {value}")
    if isinstance(value, float) and value >= 1:
        raise SparsegenError(f"{name}={value}: a float is a ratio of the prompt and must be < 1; use an int count")
    if name == "sinks" and isinstance(value, float):
        raise SparsegenError("sinks must be an int count of initial tokens")


def _resolve(value: int | float, prompt_length: int) -> int:
    """An int is a count; a float in [0, 1) is a ratio of the prompt length (H2O's '20% cache'),
    at least one token when positive (a short prompt still keeps what its policy is about)."""
    if not isinstance(value, float):
        return value
    return max(1, int(value * prompt_length)) if value > 0 else 0


@dataclass
class Policy(ABC):
    """A KV eviction policy. Subclasses are dataclasses whose fields are their settings.

    Class attributes: `name` (registry key), `default_position` ("original" or "rolling"),
    `contiguous` (the kept set is always the sinks plus a run of the newest tokens, which lets
    rolling positions rotate only the sinks), `prefill_only` (compress once, after the prompt is
    read, then keep every new token), `head_adaptive` (a prefill-only policy whose layer keeps its
    heads' budgets as one pool, the highest priorities of the whole layer: `kv.ragged`),
    `reconstructs` (scores with `Step.reconstruction`, which `decode.reading.read` computes by letting
    the model re-read the prompt; `asks_to_repeat` where it first asks the model to, in words from
    the tokenizer: `decode.kvzip_read.RepeatFrame`), `reads_keys` (scores from `Step.keys` while
    decoding: the fast path then reads them as numbers). Budget parts are the fields named sinks, heavy, recent.

    `compress_every`, every policy's one shared setting, is when a policy that evicts while
    decoding does so: 1 (the default) gives up one token a step; N lets N tokens in beyond the
    budget and then evicts N at once, as kvpress's `DecodingPress` compresses every N generated
    tokens and as R-KV and TriAttention compress when their buffer fills (`held_at_most`).
    """

    name: ClassVar[str]
    default_position: ClassVar[str] = "original"
    contiguous: ClassVar[bool] = False
    prefill_only: ClassVar[bool] = False
    head_adaptive: ClassVar[bool] = False
    reconstructs: ClassVar[bool] = False
    reads_keys: ClassVar[bool] = False

    compress_every: int = field(default=1, kw_only=True)
    """Decoding steps between evictions; each evicts as many tokens (1: one a step)."""

    def __post_init__(self) -> None:
        for part in self.budget_parts():
            _check_count(part, getattr(self, part))
        every = self.compress_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise SparsegenError(f"compress_every must be an int >= 1 (steps between evictions), got {every!r}")
        if every > 1 and (self.prefill_only or not self.budget_parts()):
            raise SparsegenError(
                f"policy {self.name!r} does not evict while decoding: compress_every applies to those that do "
                "(h2o, tova, rkv, triattention, ...)"
            )

    @property
    def asks_to_repeat(self) -> bool:
        """Whether re-reading the prompt (`reconstructs`) first asks the model to repeat it (KVzip's `instructed`)."""
        return False

    @property
    def weighs_writes(self) -> bool:
        """Whether re-reading's scores weigh each probability by what its value writes (KVzip+'s `output_norms`)."""
        return False

    def held_at_most(self, budget: int | torch.Tensor) -> int | torch.Tensor:
        """Tokens a holder of `budget` holds at most during a step: the budget, the tokens it lets
        in beyond it until it compresses (`compress_every` - 1), and the one in flight."""
        return budget + self.compress_every

    @classmethod
    def budget_parts(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name in PARTS)

    @classmethod
    def split(cls, rest: int | float) -> dict[str, int | float]:
        """How the budget left beside the sinks divides among this policy's other parts: halved
        between heavy and recent where it has both. A share halves too (H2O's "20% cache" is
        heavy 0.1 + recent 0.1). `resolve_budget` decides the sinks; subclasses may divide otherwise."""
        others = [part for part in cls.budget_parts() if part != "sinks"]
        if isinstance(rest, float):
            return {part: rest / len(others) for part in others}
        if "heavy" in others and "recent" in others:
            return {"heavy": rest // 2, "recent": rest - rest // 2}
        return {part: rest for part in others}

    def sizes(self, prompt_length: int) -> Sizes | None:
        """Resolve ratios against the prompt; None means the cache is unbounded."""
        resolved = self.resolved(prompt_length)
        sizes = Sizes(**{p: getattr(resolved, p) for p in self.budget_parts()})
        if sizes.budget == 0:
            raise SparsegenError(
                f"policy {self.name!r}: the budget resolves to 0 tokens for a {prompt_length}-token prompt; "
                "give larger counts (or ratios with a longer prompt)"
            )
        return sizes

    def resolved(self, prompt_length: int) -> Policy:
        """This policy with its shares of the prompt turned into counts for `prompt_length` tokens
        (by `resolve_budget`; a cache reading the prompt in chunks keeps the result)."""
        parts = {p: getattr(self, p) for p in self.budget_parts()}
        return dataclasses.replace(self, **resolve_budget(type(self), prompt_length, None, parts)) if parts else self

    def layer_sizes(self, sizes: Sizes, prompt_length: int, layer: int, layers: int) -> Sizes:
        """The budget of layer `layer` of `layers` (PyramidKV's shrink with depth); the same
        `sizes` in every layer by default."""
        return sizes

    def pooled_sizes(self, sizes: list[Sizes], scores: list[torch.Tensor]) -> list[Sizes]:
        """Every layer's budget at once, from every layer's scores of the prompt ([b, h, n] each),
        for a policy that scores the whole prompt before any layer evicts (`reconstructs`) and may
        share one budget among the layers (KVzip); each layer's own `sizes` by default."""
        return sizes

    def score(self, step: Step) -> torch.Tensor | None:
        """The running scores after this step ([b, h, n]), or None if the policy keeps none."""
        return None

    @abstractmethod
    def priority(self, step: Step) -> torch.Tensor:
        """Keep-priority of each held token [b, h, n]; `step.scores` are already updated. Higher
        is kept; `KEEP` always."""

    def describe(self) -> str:
        names = [f.name for f in dataclasses.fields(self) if f.name != "compress_every"]
        names += ["compress_every"] if self.compress_every != 1 else []  # said only where it is not the default
        values = [f"{name}={getattr(self, name)}" for name in names]
        return f"{self.name}({', '.join(values)})"


def count_or_share(value: str | None) -> int | float | None:
    """A budget as written (a CLI option, a bench setting): an int is a token count, a float in
    (0, 1) a share of each request."""
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        pass
    try:
        share = float(value)
    except ValueError:
        raise SparsegenError(f"{value!r} is not a token count (int) or a share of the request (float)") from None
    if not 0 < share < 1:
        raise SparsegenError(f"a budget share must be in (0, 1), got {share}")
    return share


def _check_budget(budget: int | float) -> None:
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget > 0:
        raise SparsegenError(f"budget must be an int > 0 (tokens) or a share of the prompt in (0, 1), got {budget!r}")
    if isinstance(budget, float) and budget >= 1:
        raise SparsegenError(f"budget={budget}: a float is a share of the prompt and must be < 1; use an int count")


def resolve_budget(
    policy: str | type[Policy],
    prompt_length: int | None,
    budget: int | float | None,
    parts: Mapping[str, int | float | None],
) -> dict[str, int | float]:
    """The one budget rule: what a caller gave (a total `budget`, an int count or a float share of
    the prompt, or the `parts` sinks/heavy/recent; None means not given) as the policy's parts.

    Parts stay as given. A total splits as the policy needs: the sinks first (those asked, else
    4, or half a total of 4 or less, so a small budget still holds recent tokens), the rest by
    `Policy.split`. With `prompt_length`, shares become counts: a total share keeps at least 2
    tokens and lowers asked sinks to half of them (every request of an evaluation gets the share,
    and a short one cannot hold the sinks its longer ones do). Without it, a total share splits
    into shares of the other parts (each resolved later against its own prompt), the sinks a count
    on top. Conflicts are one-line errors: a total with heavy/recent, sinks for a policy that keeps
    none, sinks not smaller than a count total.
    """
    cls = policy if isinstance(policy, type) else POLICIES.named(policy)
    parts = {name: value for name, value in parts.items() if value is not None}
    sinks = parts.get("sinks")
    if sinks is not None and "sinks" not in cls.budget_parts():
        raise SparsegenError(f"policy {cls.name!r} keeps no sinks; drop --sinks")
    if budget is None:
        return parts if prompt_length is None else {name: _resolve(v, prompt_length) for name, v in parts.items()}
    _check_budget(budget)
    if parts.keys() - {"sinks"}:
        raise SparsegenError("give a total budget (--budget, budget=) or its parts (--heavy/--recent), not both")
    if isinstance(budget, float):
        if prompt_length is None:
            first = {"sinks": DEFAULT_SINKS if sinks is None else sinks} if "sinks" in cls.budget_parts() else {}
            return {**first, **cls.split(budget)}
        budget = max(_resolve(budget, prompt_length), 2)
        sinks = None if sinks is None else min(sinks, budget // 2)
    if "sinks" not in cls.budget_parts():
        return cls.split(budget)
    if sinks is None:
        sinks = DEFAULT_SINKS if budget > DEFAULT_SINKS else budget // 2
    if sinks >= budget:
        raise SparsegenError(
            f"sinks ({sinks}) must be smaller than the budget ({budget}): raise --budget or lower --sinks"
        )
    return {"sinks": sinks, **cls.split(budget - sinks)}


def make_policy(policy: str | Policy, budget: int | float | None = None, **settings) -> Policy:
    """A policy from a registered name and its settings, the budget (a total `budget=` or the
    parts `sinks=`, `heavy=`, `recent=`) by `resolve_budget`. A `Policy` instance is returned unchanged."""
    if isinstance(policy, Policy):
        if budget is not None or settings:
            raise SparsegenError("pass budget keywords with a policy name, not with a Policy instance")
        return policy
    parts = {part: settings.pop(part) for part in PARTS if part in settings}
    return POLICIES.make(policy, **settings, **resolve_budget(policy, None, budget, parts))
