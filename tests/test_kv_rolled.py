"""Rolling positions in the fast path: keys rotated inside the product (`kv.kernels.rolled_scores`)."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.kv.kernels import kernels_available, rolled_scores
from sparsegen.kv.rope import TABLE_REACH, KeyRotation
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny


@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rolled_products_equal_rotating_the_keys_then_multiplying(rotary_dim):
    assert kernels_available()  # the machine's compiler builds them; CI has one
    generator = torch.Generator().manual_seed(3)
    rotation = KeyRotation(1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)))
    query = torch.randn(2, 3, 3, 64, generator=generator)
    buffer = torch.randn(2, 3, 70, 64, generator=generator)
    keys = buffer[:, :, 5:55]  # a view, as the slots of a larger buffer
    delta = torch.randint(-40, 41, (2, 3, 50), generator=generator)
    delta[:, :, ::4] = 0  # unmoved slots are read as they are
    expected = query @ rotation.rotate(keys, delta).transpose(-1, -2)
    torch.testing.assert_close(rolled_scores(query, keys, delta, rotation), expected, rtol=1e-5, atol=1e-5)
    for far in (3000, 50_000):  # beyond the table so far (it grows), beyond what it ever holds
        moved = torch.full_like(delta, far)
        expected = query @ rotation.rotate(keys, moved).transpose(-1, -2)
        torch.testing.assert_close(rolled_scores(query, keys, moved, rotation), expected, rtol=1e-5, atol=1e-5)


def test_a_stream_long_delta_is_computed_and_the_table_stays_bounded():
    """A stream's sinks move by every token seen: deltas of millions get their angles in float64's
    agreement (as float32 angles allow), and the table of short deltas never reaches that far."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).double() / 64))
    rotation = KeyRotation(inv_freq)
    delta = torch.tensor([[3, -700, 2_000_000, 40_000]])
    cos, sin = rotation.cos_sin(delta)
    angle = delta.double().unsqueeze(-1) * inv_freq
    expected = torch.cat((angle, angle), -1)
    # float32 holds 2,000,000 * inv_freq to about 0.12 rad in the fastest band, ~1e-4 in the slowest
    tolerance = (delta.abs().double().unsqueeze(-1) * 2**-23 + 1e-6) * torch.cat((inv_freq, inv_freq)) * 2
    assert ((cos.double() - expected.cos()).abs() <= tolerance + 1e-6).all()
    assert ((sin.double() - expected.sin()).abs() <= tolerance + 1e-6).all()
    assert rotation.table(10_000_000)[1] == TABLE_REACH


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_streaming_h2o_decodes_the_same_tokens_with_and_without_the_rolled_kernel(arch, monkeypatch):
    import sparsegen.decode.handover as handover

    model = build_tiny(arch)
    lengths = (30, 37)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths]
    fused = Decoder(model, KVSpec.of("streaming_h2o", budget=16), compile="never")
    with_kernel = generate(model, prompts, 24, decoder=fused)
    assert all(layer.rolled_products for layer in fused.state.layers)
    monkeypatch.setattr(handover, "kernels_available", lambda: False)
    plain = Decoder(model, KVSpec.of("streaming_h2o", budget=16), compile="never")
    without = generate(model, prompts, 24, decoder=plain)
    assert not any(layer.rolled_products for layer in plain.state.layers)
    assert with_kernel.tokens == without.tokens


def test_ranks_by_counting_equal_ranks_by_sorting():
    from sparsegen.kv.rope import held_ranks

    generator = torch.Generator().manual_seed(5)
    positions = torch.stack([torch.randperm(90, generator=generator)[:40] for _ in range(6)]).view(2, 3, 40)
    positions[:, :, ::7] = -1  # free slots
    positions[:, 1, 3] = -2  # a slot beyond the budget
    live = positions >= 0
    counted = held_ranks(live, positions, torch.tensor([90, 95]).view(2, 1, 1))
    sorted_ = torch.where(live, positions, torch.iinfo(torch.long).max).argsort(-1).argsort(-1)
    assert torch.equal(counted[live], sorted_[live])


def test_flat_heads_roll_each_head_on_its_own_as_plain_python_places_them():
    """Heads held flat (`kv.ragged`), some slots free: each head's live keys, in position order,
    end at `seen - 1`; a free slot does not move."""
    from sparsegen.kv.rope import roll_deltas

    generator, seen = torch.Generator().manual_seed(0), 40
    for _ in range(50):
        n, heads = (
            int(torch.randint(1, 30, (1,), generator=generator)),
            int(torch.randint(1, 5, (1,), generator=generator)),
        )
        head_of = torch.randint(0, heads, (2, 1, n), generator=generator)
        positions = torch.stack([torch.randperm(seen, generator=generator)[:n] for _ in range(2)]).view(2, 1, n)
        live = torch.rand(2, 1, n, generator=generator) > 0.3
        positions = torch.where(live, positions, -1)
        expected = torch.zeros_like(positions)
        for row in range(2):
            for head in range(heads):
                mine = [i for i in range(n) if live[row, 0, i] and head_of[row, 0, i] == head]
                in_order = sorted(int(positions[row, 0, i]) for i in mine)
                for i in mine:
                    place = seen - len(in_order) + in_order.index(int(positions[row, 0, i]))
                    expected[row, 0, i] = place - int(positions[row, 0, i])
        assert torch.equal(roll_deltas(positions, seen, live, head_of), expected)
        assert torch.equal(roll_deltas(positions, torch.full((2, 1, 1), seen), live, head_of), expected)
