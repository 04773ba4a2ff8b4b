"""Triton kernels for contextual sparsity on a GPU: products that read only the kept weight rows.

Two shapes of gather-GEMV cover both methods, at any batch size:

- `gathered_product(x, weight_t, index)`: x's kept inputs times their rows of a transposed weight
  [in, out] (TEAL's input sparsity over the fused q/k/v and gate/up, and Deja Vu's down projection
  stored [neurons, hidden]). `index` is one list for every row, or one list per row: each row then
  reads exactly its own selection (TEAL's kernel stops at batch 1; here a batch is a grid axis).
  The kept inputs are split across programs (split-K) and the partial sums added after, in fp32,
  with no atomics, so the result does not depend on scheduling.
- `product_of_rows(x, weight, index)`: x times the kept rows of a weight [out, in] (Deja Vu's
  gate and up rows of the kept neurons).

Both accumulate in fp32 and return x's dtype. Under `TRITON_INTERPRET=1` (set before this module
is imported) they run on CPU tensors, which is how the CPU test suite checks them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gathered_kernel(
    x, weight_t, index, partial, rows, kept, outs, chunk,
    stride_x, stride_w, stride_index, stride_split, stride_row,
    PER_ROW: tl.constexpr, COMPACT: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    block_n, split, group = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row = tl.arange(0, ROWS) + (group if PER_ROW else 0)
    row_ok = row < (group + 1 if PER_ROW else rows)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    start = split * chunk
    for k0 in range(start, tl.minimum(start + chunk, kept), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = (k < kept) & (k < start + chunk)
        kept_rows = tl.load(index + group * stride_index + k, mask=k_ok, other=0)
        w_ok = k_ok[:, None] & (n < outs)[None, :]
        w = tl.load(weight_t + kept_rows[:, None] * stride_w + n[None, :], mask=w_ok, other=0.0)
        column = k if COMPACT else kept_rows
        xs = tl.load(x + row[:, None] * stride_x + column[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(xs.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    tl.store(partial + split * stride_split + row[:, None] * stride_row + n[None, :], acc,
             mask=row_ok[:, None] & (n < outs)[None, :])  # fmt: skip


@triton.jit
def _rows_kernel(
    x, weight, index, out, rows, kept, width,
    stride_x, stride_w, stride_out,
    ROWS: tl.constexpr, BLOCK_U: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    u = tl.program_id(0) * BLOCK_U + tl.arange(0, BLOCK_U)
    u_ok = u < kept
    row = tl.arange(0, ROWS)
    row_ok = row < rows
    kept_rows = tl.load(index + u, mask=u_ok, other=0)
    acc = tl.zeros((ROWS, BLOCK_U), dtype=tl.float32)
    for k0 in range(0, width, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        w_ok = u_ok[:, None] & (k < width)[None, :]
        w = tl.load(weight + kept_rows[:, None] * stride_w + k[None, :], mask=w_ok, other=0.0)
        xs = tl.load(x + row[:, None] * stride_x + k[None, :], mask=row_ok[:, None] & (k < width)[None, :], other=0.0)
        acc += tl.sum(xs.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(out + row[:, None] * stride_out + u[None, :], acc, mask=row_ok[:, None] & u_ok[None, :])


def _splits(blocks: int, kept: int, block_k: int, device: torch.device) -> int:
    """Split the kept inputs so that about four programs run per streaming multiprocessor."""
    if device.type != "cuda":
        return min(2, triton.cdiv(kept, block_k))
    units = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(kept, block_k), 4 * units // max(blocks, 1)))


def gathered_product(
    x: torch.Tensor, weight_t: torch.Tensor, index: torch.Tensor, compact: bool = False
) -> torch.Tensor:
    """Σ over kept inputs i of x[b, i] * weight_t[i]: [b, out] in x's dtype.

    `weight_t` [in, out] (contiguous rows); `index` [kept] shared by every row, or [b, kept] one
    selection per row. With `compact`, x [b, kept] holds the kept values in index order (the
    activations of the kept neurons); else x [b, in] and the kernel reads x at the index.
    """
    rows, outs = x.shape[0], weight_t.shape[1]
    per_row = index.dim() == 2
    index = index.reshape(rows if per_row else 1, -1).contiguous()
    kept = index.shape[1]
    x, weight_t = x.contiguous(), weight_t.contiguous()
    block_n, block_k = 128, 32
    blocks = triton.cdiv(outs, block_n)
    splits = _splits(blocks * (rows if per_row else 1), kept, block_k, x.device)
    chunk = triton.cdiv(kept, splits)
    partial = torch.zeros(splits, rows, outs, dtype=torch.float32, device=x.device)
    group_rows = 1 if per_row else rows
    _gathered_kernel[(blocks, splits, rows if per_row else 1)](
        x, weight_t, index, partial, rows, kept, outs, chunk,
        x.stride(0), weight_t.stride(0), index.stride(0), partial.stride(0), partial.stride(1),
        PER_ROW=per_row, COMPACT=compact, ROWS=triton.next_power_of_2(group_rows), BLOCK_K=block_k, BLOCK_N=block_n,
    )  # fmt: skip
    return partial.sum(0).to(x.dtype)


def product_of_rows(x: torch.Tensor, weight: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, in] times the rows `index` [kept] of `weight` [out, in]: [b, kept] in x's dtype."""
    rows, width = x.shape
    kept = index.numel()
    x, weight, index = x.contiguous(), weight.contiguous(), index.contiguous()
    out = torch.empty(rows, kept, dtype=torch.float32, device=x.device)
    block_u = 32
    _rows_kernel[(triton.cdiv(kept, block_u),)](
        x, weight, index, out, rows, kept, width, x.stride(0), weight.stride(0), out.stride(0),
        ROWS=triton.next_power_of_2(rows), BLOCK_U=block_u, BLOCK_K=128,
    )  # fmt: skip
    return out.to(x.dtype)
