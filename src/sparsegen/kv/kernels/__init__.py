"""Attention products over rounded KV (`kv.quantized`) without a float copy of the cache.

`held_scores` is each query's dot product with each held key, `held_mix` the attention
probabilities times the held values, both over byte rows with the ring of newest tokens
(`kv.quantized`): `torch.library` ops (one opaque call in a compiled step, with a fake
implementation for tracing) over C++ (`kv_int.cpp`) that decodes one row at a time into a buffer
that stays in L1. The C++ is built on first use with the machine's compiler (`-O3 -march=native`,
cached under sparsegen's cache folder, keyed by source, CPU and torch); where it cannot be built
(`kernels_available()` is False, said once) the fast path decodes the whole cache and multiplies in
torch instead.
"""

from __future__ import annotations

import functools
import hashlib
import platform
import sys
from pathlib import Path

import torch

from sparsegen.kv.quantized import KVCodec

SOURCE = Path(__file__).with_name("kv_int.cpp")


@functools.cache
def _extension():
    """The built C++ module, or None where it cannot be built (said once on stderr)."""
    from torch.utils import cpp_extension

    from sparsegen.assets import cache_dir

    key = hashlib.sha256(SOURCE.read_bytes() + _cpu_name().encode() + torch.__version__.encode()).hexdigest()[:16]
    folder = cache_dir() / "kernels" / key
    folder.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            "sparsegen_kv_int",
            [str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],  # simd: the dot products' sums vectorize
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, headers missing: the torch path still works
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(
            f"sparsegen: the KV kernels could not be built ({reason}); rounded KV is decoded in torch", file=sys.stderr
        )
        return None


def _cpu_name() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + platform.processor() + flags


def kernels_available() -> bool:
    """Whether the C++ products are built (on a CPU; a GPU decodes in torch)."""
    return _extension() is not None


@torch.library.custom_op("sparsegen::kv_scores", mutates_args=())
def _kv_scores(query: torch.Tensor, keys: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return _extension().kv_scores(query.contiguous(), keys, bits, group)


@_kv_scores.register_fake
def _(query, keys, bits, group):
    return query.new_empty(*query.shape[:3], keys.shape[2])


@torch.library.custom_op("sparsegen::kv_mix", mutates_args=())
def _kv_mix(probs: torch.Tensor, values: torch.Tensor, bits: int, group: int, dim: int) -> torch.Tensor:
    return _extension().kv_mix(probs.contiguous(), values, bits, group, dim)


@_kv_mix.register_fake
def _(probs, values, bits, group, dim):
    return probs.new_empty(*probs.shape[:3], dim)


def newest_slots(positions: torch.Tensor, seen: torch.Tensor, ring: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which slots [b, h, n] hold one of their row's newest `ring` tokens (of `seen`), and each
    slot's ring index: computed once a step for `held_scores` and `held_mix`."""
    return (positions >= 0) & (positions >= seen - ring), positions.remainder(ring)


def held_scores(query, keys, codec: KVCodec, newest_and_index, recent_keys) -> torch.Tensor:
    """query [b, h, g, d] . every slot's key as read (`kv.quantized.with_residual`): the newest
    tokens' (`newest_slots`) from the ring `recent_keys` [b, h, R, d], the others decoded. fp32
    [b, h, g, n]."""
    scores = _kv_scores(query.float(), keys, codec.bits, codec.group)
    newest, index = newest_and_index
    ring = query.float() @ recent_keys.float().transpose(-1, -2)  # [b, h, g, R]
    ring = ring.gather(-1, index.unsqueeze(2).expand_as(scores))
    return torch.where(newest.unsqueeze(2), ring, scores)


def held_mix(probs, values, codec: KVCodec, newest_and_index, recent_values) -> torch.Tensor:
    """probs [b, h, g, n] x every slot's value as read (the newest, `newest_slots`, from the ring
    `recent_values` [b, h, R, d], the others decoded): fp32 [b, h, g, d]."""
    newest, index = newest_and_index
    newest = newest.unsqueeze(2)
    decoded = _kv_mix(torch.where(newest, 0.0, probs).float(), values, codec.bits, codec.group, recent_values.shape[-1])
    to_ring = probs.new_zeros(*probs.shape[:3], recent_values.shape[2])
    to_ring.scatter_add_(-1, index.unsqueeze(2).expand_as(probs), torch.where(newest, probs, 0.0))
    return decoded + to_ring @ recent_values.float()
