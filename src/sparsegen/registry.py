"""One registry style for every method family: KV policies, pruners, quantizers, neuron selectors.

A method is a dataclass registered by its `name`. Its init fields are its settings: typed, with a
docstring under each, validated in `__post_init__`. `settings_of` reads them back, and whatever a
method saves (a pruned or quantized checkpoint, a selectors file) records them, so the file says
how it was made. The CLI, benches, evals and tests list a family by iterating its registry.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsegen.errors import SparsegenError


class Registry(dict[str, type]):
    """Methods of one family by name. `family` names it in errors ("pruning method"), `member`
    names one of its methods ("pruner")."""

    def __init__(self, family: str, member: str) -> None:
        super().__init__()
        self.family, self.member = family, member

    def register(self, cls: type) -> type:
        """Class decorator: make a method selectable by its `name` from the API and the CLI."""
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls.__name__}: a {self.member} is a dataclass whose fields are its settings")
        self[cls.name] = cls
        return cls

    def named(self, name: str) -> type:
        """The class registered as `name`; an unknown name is a one-line error listing the known."""
        if name not in self:
            raise SparsegenError(f"unknown {self.family} {name!r}; choose one of: {', '.join(sorted(self))}")
        return self[name]

    def make(self, name: str, **settings: Any) -> Any:
        """The method `name` with `settings`; an unknown name or setting is a one-line error."""
        cls = self.named(name)
        try:
            return cls(**settings)
        except TypeError as exc:
            raise SparsegenError(f"{self.member} {name!r}: {exc}") from None

    def summary(self, name: str) -> str:
        """The first line of the method's docstring."""
        return summary_line(self[name].__doc__)

    def help(self) -> str:
        """One entry per method: its name, its settings, what it is (for the CLI's help)."""
        return "; ".join(
            help_entry(name, [f.name for f in dataclasses.fields(self[name]) if f.init], self.summary(name))
            for name in sorted(self)
        )


def summary_line(doc: str | None) -> str:
    """A docstring's first line without its final period: a method's help in one line (shared with
    `catalog`, which reads the docstrings from the source)."""
    doc = (doc or "").strip()
    return doc.splitlines()[0].rstrip(".") if doc else ""


def help_entry(name: str, settings: list[str], summary: str) -> str:
    """One method in the CLI's help: its name, its settings, what it is."""
    listed = f" ({', '.join(settings)})" if settings else ""
    return f"{name}{listed}: {summary}"


def settings_of(method: Any) -> dict[str, Any]:
    """A method's settings by name (its init fields), as recorded in what it saves."""
    return {f.name: getattr(method, f.name) for f in dataclasses.fields(method) if f.init}
