"""Calibration on several processes (`torchrun --nproc-per-node N -m sparsegen prune ...`).

Each rank runs its share of the calibration sequences through every block; the statistics are
summed over ranks (`InputStats.all_reduce`); each Linear is rewritten by one rank, in turn, and
its new weight (and whatever else the rewrite produced, such as a quantization grid) broadcast to
the others; rank 0 alone writes. Without torchrun, all of this is a no-op.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from sparsegen.errors import SparsegenError


def rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_writer() -> bool:
    """Whether this process writes results (rank 0, or the only process)."""
    return rank_and_size()[0] == 0


def init_from_env() -> None:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")


def share_of(rows: torch.Tensor) -> torch.Tensor:
    """This rank's share of the calibration sequences [n, seqlen]: every size-th row from its rank."""
    rank, size = rank_and_size()
    if rows.shape[0] < size:
        raise SparsegenError(f"{rows.shape[0]} calibration sequences for {size} ranks: use --n-samples {size} or more")
    return rows[rank::size]


def owner(index: int) -> int:
    """The rank that rewrites the `index`-th Linear of a block."""
    return index % rank_and_size()[1]


def broadcast_rewrite(weight: torch.Tensor, result: Any, source: int) -> Any:
    """Send the rewritten `weight` (in place) and the rewrite's `result` from rank `source` to all."""
    if rank_and_size()[1] == 1:
        return result
    dist.broadcast(weight, src=source)
    box = [result]
    dist.broadcast_object_list(box, src=source)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> None:
    if rank_and_size()[1] > 1:
        dist.all_reduce(tensor)


def leave() -> None:
    """Leave the process group once the ranks' shared work is done, so that rank 0 writes alone
    (libraries that see a process group, such as compressed-tensors, would otherwise wait for the
    other ranks)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
