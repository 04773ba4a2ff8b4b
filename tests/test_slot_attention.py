"""A decode step's attention over fp32 or fp16 slots in one call (`kv.kernels.slot_attention`)."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.kv.kernels import kernels_available, slot_attention
from tests.conftest import build_tiny


def masked_softmax_attention(query, keys, values, positions, scaling):
    """The plain torch computation the op replaces: products, a mask of the live slots, softmax."""
    logits = (query @ keys.transpose(-1, -2)) * scaling
    logits = logits.masked_fill(~(positions >= 0).unsqueeze(2), float("-inf"))
    return logits.softmax(-1) @ values


@pytest.mark.parametrize("held", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("b", "h", "g", "d", "n"), [(2, 3, 3, 64, 300), (1, 2, 4, 48, 37), (1, 3, 3, 64, 1100), (3, 2, 6, 128, 70)]
)
def test_slot_attention_equals_masked_softmax_over_the_live_slots(b, h, g, d, n, held):
    """fp16 slots: the same attention over the rows as held, widened (the reference in float64)."""
    assert kernels_available()  # the machine's compiler builds them; CI has one
    generator = torch.Generator().manual_seed(n)
    query, keys, values = (torch.randn(b, h, k, d, generator=generator) for k in (g, n, n))
    positions = torch.randint(-2, 5000, (b, h, n), generator=generator)  # -1 free, -2 beyond the budget
    positions[..., -1] = 7  # every row and head holds at least one token
    if n > 1000:
        positions[..., : n // 2] = -1  # whole parts of the slots empty: their share must vanish
    keys, values = keys.to(held), values.to(held)
    expected = masked_softmax_attention(query.double(), keys.double(), values.double(), positions, d**-0.5)
    got = slot_attention(query, keys, values, positions, d**-0.5)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("held", [torch.float32, torch.float16])
def test_a_row_s_attention_is_the_same_bit_for_bit_alone_or_among_rows_with_more_slots(held):
    """A row decoded alone, or beside 7 others in a call whose slot count their longer rows set,
    gets one result to the last bit (parts of the slots split by the call's shape summed it in
    another order: the server's answers then depended on the rows it served together)."""
    assert kernels_available()
    generator = torch.Generator().manual_seed(3)
    query, keys, values = (torch.randn(8, 3, 3, 64, generator=generator) for _ in range(3))
    keys, values = (torch.randn(8, 3, 900, 64, generator=generator).to(held) for _ in range(2))
    positions = torch.arange(900).expand(8, 3, 900).clone()
    positions[0, :, 600:] = -1  # row 0 holds 600 tokens, the others 900
    alone = slot_attention(
        query[:1],
        keys[:1, :, :600].contiguous(),
        values[:1, :, :600].contiguous(),
        positions[:1, :, :600].contiguous(),
        0.125,
    )
    together = slot_attention(query, keys, values, positions, 0.125)
    assert torch.equal(alone[0], together[0])


def test_slot_attention_compiles_as_one_call_for_any_row_and_slot_count():
    torch._dynamo.reset()
    compiled = torch.compile(slot_attention, fullgraph=True, dynamic=True)
    for b, n in ((1, 40), (3, 90)):
        query, keys, values = torch.randn(b, 2, 2, 32), torch.randn(b, 2, n, 32), torch.randn(b, 2, n, 32)
        positions = torch.arange(n).expand(b, 2, n).contiguous()
        positions[:, :, 5:9] = -1
        expected = masked_softmax_attention(query, keys, values, positions, 0.2)
        torch.testing.assert_close(compiled(query, keys, values, positions, 0.2), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("held", [torch.float32, torch.float16])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_full_cache_decodes_the_same_with_and_without_the_fused_attention(arch, held, monkeypatch):
    import sparsegen.decode.handover as handover

    model = build_tiny(arch)
    prompts = [torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (30, 37)]
    fused = Decoder(model, "full", compile="never", kv_dtype=held)
    with_kernel = generate(model, prompts, 20, decoder=fused)
    assert all(layer.fused_attention and layer.keys.dtype == held for layer in fused.state.layers)
    monkeypatch.setattr(handover, "kernels_available", lambda: False)
    plain = Decoder(model, "full", compile="never", kv_dtype=held)
    without = generate(model, prompts, 20, decoder=plain)
    assert not any(layer.fused_attention for layer in plain.state.layers)
    assert with_kernel.tokens == without.tokens


@pytest.mark.parametrize(
    ("kv", "held"), [("full", torch.float16), ("h2o", torch.float32), ("streaming", torch.float32)]
)
def test_a_cpu_decoder_holds_fp16_only_where_every_layer_attends_in_the_fused_kernel(kv, held, monkeypatch):
    import sparsegen.decode.handover as handover

    model = build_tiny("llama")
    prompt = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    decoder = Decoder(model, kv, compile="never")
    generate(model, [prompt], 4, decoder=decoder)
    assert decoder.kv_dtype == held and all(layer.keys.dtype == held for layer in decoder.state.layers)
    monkeypatch.setattr(handover, "kernels_available", lambda: False)  # no kernel to read fp16: fp32
    plain = Decoder(model, kv, compile="never")
    generate(model, [prompt], 4, decoder=plain)
    assert plain.kv_dtype == torch.float32
