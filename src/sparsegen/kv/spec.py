"""KVSpec: one KV configuration (a policy with its budget, the keys' positions, the KV's bits) as
one typed value, validated once where it is built and passed whole wherever a cache is made.

It is also the one rule for which rows may decode in one batched step (`step_key`): the server's
lanes, RULER's groups of cells and the hand-over of rows that share a context all ask it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from sparsegen.errors import SparsegenError
from sparsegen.kv.policy import PARTS, POLICIES, Policy, make_policy
from sparsegen.kv.quantized import checked_bits
from sparsegen.registry import settings_of

POSITIONS = ("original", "rolling")
PER_ROW = ("heavy", "recent")
"""Budget parts each row of a batched step holds for itself (`Sizes` per row); the sinks are not
among them: they fix where the slots' rolled keys sit, so rows with other sinks decode apart."""


@dataclass(frozen=True)
class KVSpec:
    """A KV configuration: a built `policy` (its budget parts and settings), `position`
    ("original": keys keep their place in the text, "rolling": places within the cache, None: the
    policy's default), `kv_bits` (None: full precision; else `kv.quantized.checked_bits`) and
    `kv_rotated` (quantized KV is rounded after a signed Hadamard rotation unless False).

    Build it from a name and keywords with `KVSpec.of("h2o", budget=128, kv_bits=4)`; anything
    wrong fails there, as one line. `to_dict`/`from_dict` record it in results (JSON)."""

    policy: Policy
    position: str | None = None
    kv_bits: int | None = None
    kv_rotated: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise SparsegenError(
                f"KVSpec takes a built Policy, got {self.policy!r}: use KVSpec.of(name, budget=...) for a name"
            )
        if self.position not in (None, *POSITIONS):
            raise SparsegenError(f"position must be one of {POSITIONS} (or None: the policy's), got {self.position!r}")
        checked_bits(self.kv_bits)
        if not isinstance(self.kv_rotated, bool):
            raise SparsegenError(f"kv_rotated is True or False, got {self.kv_rotated!r}")

    @classmethod
    def of(
        cls,
        policy: str | Policy = "full",
        *,
        position: str | None = None,
        kv_bits: int | None = None,
        kv_rotated: bool = True,
        budget: int | float | None = None,
        **settings: Any,
    ) -> KVSpec:
        """The spec as a CLI or a caller writes it: a policy name with its budget (a total
        `budget=`, an int count or a float share of the prompt, or the parts `sinks=`, `heavy=`,
        `recent=`) and its own settings (checked by the policy: an unknown one is an error)."""
        return cls(make_policy(policy, budget=budget, **settings), position, kv_bits, kv_rotated)

    @classmethod
    def coerce(cls, kv: KVSpec | str | Policy) -> KVSpec:
        """`kv` as a spec: a bare name or Policy is that policy at its defaults, full precision."""
        return kv if isinstance(kv, KVSpec) else cls.of(kv)

    @property
    def name(self) -> str:
        return self.policy.name

    @property
    def placement(self) -> str:
        """The keys' positions this spec decodes at: the one asked, else the policy's default."""
        return self.position or self.policy.default_position

    def resolved(self, prompt_length: int) -> KVSpec:
        """This spec with its budget's shares of the prompt turned into counts (`Policy.resolved`)."""
        return dataclasses.replace(self, policy=self.policy.resolved(prompt_length))

    def asked(self, policy: str | None, budget: int | float | None, kv_bits: int | None) -> KVSpec:
        """The spec a request asks for over this default one: this policy and budget where it
        names neither, else its policy (this one where it names only a budget or this policy) at that
        budget, with this policy's other settings where it is this one (`compress_every`, ...); in
        `kv_bits`, at this spec's position and rotation."""
        if policy is None and budget is None:
            return dataclasses.replace(self, kv_bits=kv_bits)
        same = policy in (None, self.name)
        settings = {k: v for k, v in settings_of(self.policy).items() if k not in PARTS} if same else {}
        return KVSpec.of(
            policy or self.name,
            budget=budget,
            position=self.position,
            kv_bits=kv_bits,
            kv_rotated=self.kv_rotated,
            **settings,
        )

    def step_key(self) -> tuple:
        """What rows decoding in one batched step must share: the policy and every setting of it
        but the per-row heavy and recent counts (the sinks included), the positions and the bits."""
        rounding = (self.kv_bits, self.kv_rotated) if self.kv_bits is not None else None
        return (self.name, self.placement, rounding, policy_step_settings(self.policy))

    def shares_step_with(self, other: KVSpec) -> bool:
        return self.step_key() == other.step_key()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: the policy's name and settings (its init fields; `compress_every` where it is
        not 1, so records of one-a-step eviction read as before), the position and the bits."""
        settings = settings_of(self.policy)
        if settings["compress_every"] == 1:
            del settings["compress_every"]
        return {
            "policy": self.name,
            "settings": settings,
            "position": self.position,
            "kv_bits": self.kv_bits,
            "kv_rotated": self.kv_rotated,
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> KVSpec:
        """A spec `to_dict` recorded; a bad record is a one-line error, as a bad spec is."""
        if not isinstance(saved, dict) or not isinstance(saved.get("policy"), str):
            raise SparsegenError(f"a recorded KV spec is a dict with a policy name, got {saved!r}")
        unknown = saved.keys() - {"policy", "settings", "position", "kv_bits", "kv_rotated"}
        if unknown:
            raise SparsegenError(f"a recorded KV spec has unknown keys {sorted(unknown)}")
        policy = POLICIES.make(saved["policy"], **(saved.get("settings") or {}))
        return cls(policy, saved.get("position"), saved.get("kv_bits"), saved.get("kv_rotated", True))

    def describe(self) -> str:
        """One short line for tables and logs: the policy's settings, then the position and bits asked."""
        extra = [f"position={self.position}"] if self.position else []
        if self.kv_bits is not None:
            extra += [f"int{self.kv_bits}" + ("" if self.kv_rotated else " unrotated")]
        return " ".join([self.policy.describe(), *extra])

    def __str__(self) -> str:
        return self.describe()

    def __hash__(self) -> int:  # the Policy inside is a mutable dataclass: hash what is recorded
        return hash(json.dumps(self.to_dict(), sort_keys=True))


def policy_step_settings(policy: Policy) -> tuple:
    """The settings of `policy` that rows of one batched step must share: all but `PER_ROW`
    (`KVSpec.step_key`; `decode.context` groups the rows it evicts for by the same rule)."""
    kept = (f.name for f in dataclasses.fields(policy) if f.name not in PER_ROW)
    return (type(policy).name, *((name, getattr(policy, name)) for name in kept))
