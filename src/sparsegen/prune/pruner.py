"""What a pruner is: a rule that turns one Linear layer's dense weight sparse.

A pruner receives the weight and, when it asks for them, statistics of the layer's calibration
inputs, and returns the weight with the pattern's share of entries set to zero (it may also
update the remaining entries, as SparseGPT does). One file per pruner; each registers by name.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from sparsegen.errors import SparsegenError
from sparsegen.layerwise import InputStats, LinearRewrite
from sparsegen.registry import Registry

PRUNERS = Registry("pruning method", "pruner")
register_pruner = PRUNERS.register


@dataclass(frozen=True)
class Pattern:
    """The shape of sparsity: a ratio of zeros per layer (unstructured), or N zeros in every M inputs."""

    sparsity: float
    n: int = 0
    m: int = 0

    @property
    def is_nm(self) -> bool:
        return self.m > 0

    def __str__(self) -> str:
        return f"{self.n}:{self.m}" if self.is_nm else "unstructured"

    @classmethod
    def parse(cls, sparsity: float, pattern: str | None = None) -> Pattern:
        """`pattern` is None/"unstructured" (uses `sparsity`) or "N:M" (sparsity becomes N/M)."""
        if pattern in (None, "", "unstructured"):
            if not 0 <= sparsity < 1:
                raise SparsegenError(f"sparsity must be in [0, 1), got {sparsity}")
            return cls(sparsity)
        try:
            n, m = (int(part) for part in pattern.split(":"))
        except ValueError:
            raise SparsegenError(f"pattern must be 'unstructured' or 'N:M' like '2:4', got {pattern!r}") from None
        if not 0 < n < m:
            raise SparsegenError(f"N:M pattern needs 0 < N < M, got {pattern!r}")
        return cls(n / m, n, m)


def inverse_hessian_factor(hessian: torch.Tensor, weight: torch.Tensor, damping: float, method: str) -> torch.Tensor:
    """Upper Cholesky factor of the damped H^-1 (the OBS machinery SparseGPT and GPTQ share).

    Inputs that never fire get H_jj = 1 and their weight column zeroed in place; damping adds
    `damping` * mean(diag H) to the diagonal.
    """
    hessian = hessian.double()  # the inverse of an ill-conditioned H needs the headroom
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1
    weight[:, dead] = 0
    hessian.diagonal().add_(damping * hessian.diagonal().mean())
    try:
        lower = torch.linalg.cholesky(hessian)
        inverse = torch.cholesky_inverse(lower)
        return torch.linalg.cholesky(inverse, upper=True).float()
    except torch.linalg.LinAlgError as exc:
        raise SparsegenError(
            f"{method}: the Hessian is not positive definite; use more calibration samples or a larger damping"
        ) from exc


@dataclass
class Pruner(LinearRewrite):
    """Base class: set `name`, `needs_calibration` (default True), `needs_hessian`; implement
    `prune_weight`."""

    needs_calibration: ClassVar[bool] = True

    @abstractmethod
    def prune_weight(self, weight: torch.Tensor, pattern: Pattern, stats: InputStats | None) -> torch.Tensor:
        """Return the pruned weight [out, in] (float32)."""


def mask_lowest(score: torch.Tensor, pattern: Pattern, per_row: bool) -> torch.Tensor:
    """Boolean mask of entries to zero: the lowest scores per row (or per matrix), or N lowest of every M."""
    rows, cols = score.shape
    mask = torch.zeros_like(score, dtype=torch.bool)
    if pattern.is_nm:
        if cols % pattern.m:
            raise SparsegenError(f"{cols} input columns are not a multiple of M={pattern.m}")
        groups = score.reshape(rows, cols // pattern.m, pattern.m)
        lowest = groups.topk(pattern.n, dim=-1, largest=False).indices
        return mask.reshape(rows, cols // pattern.m, pattern.m).scatter_(-1, lowest, True).reshape(rows, cols)
    if per_row:
        count = int(cols * pattern.sparsity)
        if count:
            mask.scatter_(1, score.topk(count, dim=1, largest=False).indices, True)
        return mask
    count = int(score.numel() * pattern.sparsity)
    if count:
        mask.view(-1)[score.flatten().topk(count, largest=False).indices] = True
    return mask


def make_pruner(method: str, **settings) -> Pruner:
    """A registered pruner by name with its settings (e.g. SparseGPT's `block_size`)."""
    return PRUNERS.make(method, **settings)
