"""R-KV's running redundancy: the blockwise update equals the pairwise definition, and the newest
of two duplicate keys is the one kept."""

import torch

from sparsegen.kv import make_policy, rkv
from sparsegen.kv.cache import PolicyLayer


def test_later_similarity_in_blocks_equals_every_pair(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3, 11, 8, generator=gen)
    positions = torch.randperm(11, generator=gen).expand(2, 3, 11).contiguous()
    monkeypatch.setattr(rkv, "_BLOCK", 1)  # one new key per block
    got = rkv.later_similarity(keys, positions, new=5)
    unit = torch.nn.functional.normalize(keys, dim=-1)
    want = torch.zeros(2, 3, 11)
    for i in range(11):
        for j in range(11):
            if positions[0, 0, j] >= 6 and positions[0, 0, i] < positions[0, 0, j]:
                want[:, :, i] = torch.maximum(want[:, :, i], (unit[:, :, i] * unit[:, :, j]).sum(-1))
    torch.testing.assert_close(got, want)


def test_of_two_duplicate_keys_the_newest_stays():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 8, 8, generator=gen)
    keys[:, :, 5] = keys[:, :, 2] * 2  # token 5 repeats token 2
    layer = PolicyLayer(make_policy("rkv", sinks=1, heavy=4, recent=2, importance=0.0))
    held, _ = layer.update(keys, torch.randn(1, 1, 8, 8, generator=gen))
    layer.after_attention(torch.randn(1, 1, 8, 8, generator=gen), held, 8**-0.5)
    kept = layer.kept_positions()[0][0]
    assert 5 in kept and 2 not in kept
