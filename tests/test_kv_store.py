"""The slot store against plain Python: a list of (position, key, value, score) slots per row and head."""

import random

import torch

from sparsegen.kv.quantized import RESIDUAL, SINKS, KVCodec
from sparsegen.kv.store import DEAD, EMPTY, SlotStore

B, H, D = 3, 2, 4


def as_lists(store: SlotStore) -> list[list[list[tuple]]]:
    """Every slot as (position, key, value, score), per row and head, in plain Python."""
    out = []
    for b in range(store.keys.shape[0]):
        out.append([])
        for h in range(H):
            out[-1].append(
                [
                    (
                        int(store.positions[b, h, s]),
                        tuple(store.keys[b, h, s].tolist()),
                        tuple(store.values[b, h, s].tolist()),
                        float(store.scores[b, h, s]),
                    )
                    for s in range(store.capacity)
                ]
            )
    return out


def token(b: int, h: int, position: int) -> tuple:
    """The key (and, negated, the value) a row and head holds for `position`."""
    return tuple(float(100 * b + 10 * h + position + i / 8) for i in range(D))


def tokens(positions: list[int], b: int = B) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    keys = torch.tensor([[[token(r, h, p) for p in positions] for h in range(H)] for r in range(b)])
    at = torch.tensor(positions).expand(b, H, len(positions)).clone()
    return keys, -keys, at


def test_writes_compaction_growth_and_rows_match_plain_python():
    rng = random.Random(0)
    keys, values, at = tokens([0, 1, 2, 3])
    store = SlotStore.empty(keys, values, None)
    store.grow(6, DEAD)
    store.write(0, keys, values, at)
    ref = [
        [[(p, token(b, h, p), tuple(-x for x in token(b, h, p)), 0.0) for p in range(4)] for h in range(H)]
        for b in range(B)
    ]
    for row in ref:
        for head in row:
            head += [(DEAD, (0.0,) * D, (0.0,) * D, 0.0)] * 2
    assert as_lists(store) == ref

    slot = torch.tensor([[[rng.randrange(6)] for _ in range(H)] for _ in range(B)])
    new_keys, new_values, new_at = tokens([7])
    store.scores.fill_(0.5)
    store.put(slot, new_keys, new_values, new_at)
    for b in range(B):
        for h in range(H):
            ref[b][h] = [(p, k, v, 0.5) for p, k, v, _ in ref[b][h]]
            ref[b][h][int(slot[b, h, 0])] = (7, token(b, h, 7), tuple(-x for x in token(b, h, 7)), 0.0)
    assert as_lists(store) == ref

    index = torch.tensor([[sorted(rng.sample(range(6), 3)) for _ in range(H)] for _ in range(B)])
    store.keep(index, 5)
    zero = (0, (0.0,) * D, (0.0,) * D, 0.0)
    ref = [[[ref[b][h][int(s)] for s in index[b, h]] + [zero] * 2 for h in range(H)] for b in range(B)]
    assert as_lists(store) == ref

    store.select([2, 0])
    ref = [ref[2], ref[0]]
    assert as_lists(store) == ref

    other = SlotStore.empty(*tokens([0], b=1)[:2], None)
    other.grow(5, EMPTY)
    store.extend(other)
    assert as_lists(store) == ref + [[[(EMPTY, (0.0,) * D, (0.0,) * D, 0.0)] * 5] * H]


def test_the_quantized_read_takes_the_first_and_newest_tokens_from_the_ring_and_the_rest_from_bytes():
    """A prompt chunk longer than the ring: its first SINKS and newest RESIDUAL tokens read exactly,
    the others decoded from bytes rounded less the row's centre (the mean key of positions 1..SINKS-1,
    plain Python) and decoded plus it."""
    codec = KVCodec.for_dim(4, D, rotated=False)
    seen = SINKS + RESIDUAL + 8
    keys, values, at = tokens(list(range(seen)), b=1)
    keys = keys + 5.0 + torch.randn(keys.shape, generator=torch.Generator().manual_seed(0))  # constant + noise
    store = SlotStore.empty(keys, values, codec)
    store.grow(seen)
    store.remember(keys, values, at)
    store.write(0, store.stored("keys", keys), store.stored("values", values), at)
    centre = [[sum(keys[0, h, p, c].item() for p in range(1, SINKS)) / (SINKS - 1) for c in range(D)] for h in range(H)]
    torch.testing.assert_close(store.centre("keys"), torch.tensor([centre]), rtol=1e-6, atol=1e-6)
    read = store.read_one("keys", seen, count=seen - 2)
    shift = torch.tensor(centre)
    for p in range(seen - 2):
        exact = p < SINKS or p >= seen - RESIDUAL
        rounded = codec.decode(codec.encode(keys[:, :, p : p + 1] - shift[None, :, None]))[:, :, 0] + shift
        torch.testing.assert_close(read[:, :, p], keys[:, :, p] if exact else rounded, rtol=0, atol=1e-5)
    old = list(range(SINKS, seen - RESIDUAL))
    assert (read[:, :, old] - keys[:, :, old]).abs().max() > 0  # rounded: read from the bytes
