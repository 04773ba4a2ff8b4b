"""Keys and values in 8, 4, 3 and 2 bits: the codec's rounding, every policy on both engines, bytes held."""

import pytest
import torch
from transformers import DynamicCache

from sparsegen.decode import Decoder, generate
from sparsegen.errors import SparsegenError
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.footprint import kv_bytes_per_token, kv_ring_bytes
from sparsegen.kv.policy_cache import layer_state, load_layer_state
from sparsegen.kv.quantized import BITS, CLIPS, RESIDUAL, RING_SLOTS, SINKS, KVCodec, row_centre, with_residual
from sparsegen.kv.spec import KVSpec
from tests.codec_reference import round_trip_reference
from tests.conftest import build_tiny
from tests.kv_reference import TABLE, generate_drop_in

SMALL = {name: row.small for name, row in TABLE.items()}


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [16, 64, 96, 128])
def test_codec_rounds_each_group_as_the_float64_reference_and_no_worse_than_min_max(bits, dim):
    """Unrotated; the rotated codec's rounding is `test_kv_rotation`'s."""
    codec = KVCodec.for_dim(bits, dim, rotated=False)
    x = torch.randn(2, 3, 50, dim, generator=torch.Generator().manual_seed(dim)) * 4
    x[0, 0, 0] = 7.0  # a constant vector decodes exactly
    stored = codec.encode(x)
    assert stored.dtype == torch.uint8
    assert stored.shape[-1] == codec.width(dim) == dim * bits // 8 + dim // codec.group * 4
    back = codec.decode(stored).double()
    expected = round_trip_reference(x, bits, codec.group, torch.eye(dim, dtype=torch.float64))
    assert float((back - expected).abs().gt(1e-3).double().mean()) < 0.01  # float32 may tie-break apart
    groups = x.double().view(2, 3, 50, dim // codec.group, codec.group)
    identity = torch.eye(dim, dtype=torch.float64)
    min_max = round_trip_reference(x, bits, codec.group, identity, shares=(1.0,)).view_as(groups)
    error, min_max_error = ((back.view_as(groups) - groups).square().sum(-1), (min_max - groups).square().sum(-1))
    assert bool((error <= min_max_error * 1.01 + 1e-4).all())  # each group: at worst min-max's error
    if len(CLIPS[bits]) > 1:  # clipping the range pays on Gaussian numbers: the extremes of 32 widen every step
        assert float(error.sum()) < 0.9 * float(min_max_error.sum())
    else:  # min-max: every number within half a step
        step = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / ((1 << bits) - 1)
        assert bool(((back.view_as(groups) - groups).abs() <= step / 2 + 1e-3 * groups.abs() + 1e-6).all())
    assert torch.equal(back[0, 0, 0].float(), x[0, 0, 0])


@pytest.mark.parametrize("bits", BITS)
def test_a_centre_is_taken_off_before_rounding_and_put_back_per_head_also_held_flat(bits):
    """Keys that are a large per-row-and-head constant plus noise round as finely as the noise
    alone when the constant is the centre; read flat (heads side by side, tagged), each slot gets
    its own row's and head's centre back."""
    gen = torch.Generator().manual_seed(bits)
    codec = KVCodec.for_dim(bits, 64)
    centre, noise = torch.randn(2, 3, 64, generator=gen) * 300, torch.randn(2, 3, 20, 64, generator=gen)
    x = noise + centre[:, :, None]
    noise_error = (codec.decode(codec.encode(noise)) - noise).abs().max()
    back = codec.decode(codec.encode(x, centre), centre=centre)
    assert float((back - x).abs().max()) < 1.5 * float(noise_error)
    assert float((codec.decode(codec.encode(x)) - x).abs().max()) > 4 * float(noise_error)  # uncentred
    flat_rows = codec.encode(x, centre).transpose(1, 2).reshape(2, 1, 60, -1)  # token-major, heads tagged
    head_of = torch.arange(3).repeat(20).expand(2, 1, 60)
    flat = codec.decode(flat_rows, centre=centre, head_of=head_of)
    torch.testing.assert_close(flat, back.transpose(1, 2).reshape(2, 1, 60, 64))


def test_bad_bit_widths_get_one_line_errors():
    model = build_tiny("llama")
    for call in (
        lambda: make_cache(model, KVSpec.of("h2o", budget=8, kv_bits=5)),
        lambda: generate(model, _prompt(5), 2, KVSpec.of("full", kv_bits=16)),
    ):
        with pytest.raises(SparsegenError, match="kv_bits must be one of") as error:
            call()
        assert "\n" not in str(error.value)


def _give_keys_a_slow_bias(model, first_head_extra: float = 0.0) -> None:
    """Every layer's key bias 1,000 and -600 in the slowest RoPE pair of every head, as in Qwen2.5's
    first layer (and `first_head_extra` in a fast channel of head 0, so that heads' centres differ)."""
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            bias = layer.self_attn.k_proj.bias.view(-1, d)
            bias[:, d // 2 - 1], bias[:, -1], bias[0, 3] = 1000.0, -600.0, bias[0, 3] + first_head_extra


def _biased_logits(model, bits: int | None) -> torch.Tensor:
    """Logits of a fixed 96-token prompt read 8 tokens a forward into a full cache in `bits`."""
    cache = make_cache(model, KVSpec.of("full", kv_bits=bits))
    ids, out = _prompt(96), []
    with torch.inference_mode(), policy_attention(model):
        for start in range(0, 96, 8):
            out.append(model(input_ids=ids[:, start : start + 8], cache=cache, use_cache=True).logits[0])
    return torch.cat(out)


def test_a_large_key_bias_is_taken_off_before_rounding_and_put_back(monkeypatch):
    """Qwen2.5's first layer's key bias (354 on the 1.5B model) lies in its slowest RoPE bands:
    rounded with it, per-token int4 keys lost the rest (perplexity x41). Less the row's key centre
    (`row_centre`), the logits stay near the dense forward's, about as near as without the bias."""
    import sparsegen.kv.store as store

    model, ids = build_tiny("qwen2"), _prompt(96)
    with torch.no_grad():
        unbiased = {bits: _biased_logits(model, bits) for bits in (4, 3)}
        unbiased_dense = model(ids).logits[0]
        _give_keys_a_slow_bias(model)
        dense = model(ids).logits[0]
    assert float((dense - unbiased_dense).abs().max()) > 0.01  # the bias changes what attention reads
    for bits in (4, 3):
        unbiased_error = float((unbiased[bits] - unbiased_dense).abs().max())
        centred = float((_biased_logits(model, bits) - dense).abs().max())
        with monkeypatch.context() as patch:  # rounded as they are
            patch.setattr(store, "row_centre", lambda ring: torch.zeros_like(ring[:, :, 0]).float())
            uncentred = float((_biased_logits(model, bits) - dense).abs().max())
        assert centred < 0.25 * uncentred and centred < 4 * unbiased_error


def test_a_rows_first_tokens_stay_exact_and_its_centre_is_their_mean_key():
    """After 70 tokens in 3 bits, a drop-in cache reads positions 0..SINKS-1 exactly as transformers'
    own cache holds them (older ones rounded), and each row's centre is the mean of its keys at
    positions 1..SINKS-1 (plain Python over transformers' cache)."""
    model, ids = build_tiny("qwen2"), torch.cat([_prompt(70), _prompt(70, seed=2)])
    dense, cache = DynamicCache(config=model.config), make_cache(model, KVSpec.of("full", kv_bits=3))
    with torch.inference_mode(), policy_attention(model):
        model(ids, cache=dense)
        model(ids[:, :40], cache=cache)
        for start in range(40, 70, 6):
            model(ids[:, start : start + 6], cache=cache)
    for layer, reference in zip(cache.layers, dense.layers, strict=True):
        keys = layer.store.read_one("keys", 70)
        torch.testing.assert_close(keys[:, :, :SINKS], reference.keys[:, :, :SINKS], rtol=1e-5, atol=1e-5)
        assert float((keys[:, :, SINKS:30] - reference.keys[:, :, SINKS:30]).abs().max()) > 1e-3  # rounded
        b, h, _, d = reference.keys.shape
        mean = [
            [
                [sum(float(reference.keys[r, k, p, c]) for p in range(1, SINKS)) / (SINKS - 1) for c in range(d)]
                for k in range(h)
            ]
            for r in range(b)
        ]
        torch.testing.assert_close(row_centre(layer.store.recent_keys), torch.tensor(mean), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "policy, settings",
    [
        ("h2o", {"heavy": 20, "recent": 20}),  # the byte kernels
        ("streaming", {"sinks": 4, "recent": 36, "position": "rolling"}),  # rolled sinks decoded
        ("keydiff", {"heavy": 40}),  # reads keys: decoded in torch
        ("adakv", {"sinks": 1, "heavy": 40}),  # heads held flat
    ],
)
def test_centred_keys_read_the_same_on_both_engines(policy, settings):
    """With a large key bias (so a large centre), a 60-token prompt and 10 steps in int4: the fast
    path's reads (byte products plus q.c, decoded rows plus c, flat heads' own centres) and the
    drop-in cache's give the same logits at every step."""
    model = build_tiny("qwen2")
    _give_keys_a_slow_bias(model, first_head_extra=40.0)
    ids = _prompt(60)[0].tolist()
    spec = KVSpec.of(policy, kv_bits=4, **settings)
    decoder, cache = Decoder(model, spec, compile="never"), make_cache(model, spec)
    with policy_attention(model), torch.inference_mode():
        fast, drop_in = [decoder.start([ids], 80)[0]], [model(torch.tensor([ids]), cache=cache).logits[0, -1]]
        for _ in range(10):
            token = int(drop_in[-1].argmax())
            fast.append(decoder.step(torch.tensor([token]))[0])
            drop_in.append(model(torch.tensor([[token]]), cache=cache).logits[0, -1])
    torch.testing.assert_close(torch.stack(fast), torch.stack(drop_in), rtol=1e-4, atol=1e-4)
    assert float(row_centre(cache.layers[0].store.recent_keys).abs().max()) > 500


@pytest.mark.parametrize("bits", [8, 2])
def test_rolled_sinks_and_rounded_tokens_read_alike_on_both_engines(bits):
    """Streaming with rolling positions re-rotates its sinks every step (read from the ring: they
    are among each row's first SINKS) and the tokens after them from their rounded bytes once
    older than the ring's newest RESIDUAL: both engines' logits stay equal to float noise at every
    step, 8 steps past the prompt's tokens after the first SINKS leaving the newest RESIDUAL."""
    model = build_tiny("llama")
    ids = _prompt(21)[0].tolist()
    spec = KVSpec.of("streaming", kv_bits=bits, position="rolling", sinks=2, recent=4)
    decoder, cache = Decoder(model, spec, compile="never"), make_cache(model, spec)
    with policy_attention(model), torch.inference_mode():
        fast, drop_in = [decoder.start([ids], 64)[0]], [model(torch.tensor([ids]), cache=cache).logits[0, -1]]
        for _ in range(RESIDUAL - len(ids) + SINKS + 8):
            token = int(drop_in[-1].argmax())
            fast.append(decoder.step(torch.tensor([token]))[0])
            drop_in.append(model(torch.tensor([[token]]), cache=cache).logits[0, -1])
    torch.testing.assert_close(torch.stack(fast), torch.stack(drop_in), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("policy", list(SMALL))
def test_fast_path_equals_the_drop_in_cache_at_each_bit_width(arch, policy, bits):
    """The static slots and the policy cache round, store and attend the same way."""
    model = build_tiny(arch)
    ids = _prompt(21)
    reference = generate_drop_in(model, ids, make_cache(model, KVSpec.of(policy, kv_bits=bits, **SMALL[policy])), 24)
    out = generate(model, ids, 24, KVSpec.of(policy, kv_bits=bits, **SMALL[policy]), compile="never")
    assert out.tokens[0] == reference


@pytest.mark.parametrize("policy", list(SMALL))
def test_8_bit_kv_keeps_every_policys_greedy_tokens(arch, policy):
    model = build_tiny(arch)
    ids = _prompt(21)
    full_precision = generate(model, ids, 12, KVSpec.of(policy, **SMALL[policy]), compile="never")
    eight_bits = generate(model, ids, 12, KVSpec.of(policy, kv_bits=8, **SMALL[policy]), compile="never")
    assert eight_bits.tokens == full_precision.tokens


@pytest.mark.parametrize("bits", BITS)
def test_full_cache_in_bits_equals_transformers_cache_rounded_after_each_forward(bits):
    """The reference of the arithmetic: a plain `DynamicCache` whose held keys and values are
    rounded through the codec after every forward, all but the first SINKS and newest RESIDUAL
    tokens (each forward reading its own tokens unrounded), keys less the mean of the exact keys at
    positions 1..SINKS-1 and plus it after, gives the same logits, step by step."""
    model = build_tiny("qwen2")
    ids = _prompt(90)[0].tolist()
    codec = KVCodec.for_dim(bits, model.config.hidden_size // model.config.num_attention_heads)
    decoder = Decoder(model, KVSpec.of("full", kv_bits=bits), compile="never")
    with policy_attention(model), torch.inference_mode():
        logits = [decoder.start([ids[:40]], 64)[0]]
        for token in ids[40:-1]:
            logits.append(decoder.step(torch.tensor([token]))[0])
    cache, reference, exact = DynamicCache(config=model.config), [], {}
    with torch.inference_mode():
        for chunk in [ids[:40]] + [[token] for token in ids[40:-1]]:
            reference.append(model(torch.tensor([chunk]), cache=cache).logits[0, -1])
            for index, layer in enumerate(cache.layers):
                for name in ("keys", "values"):
                    held = (
                        torch.cat([exact[index, name], getattr(layer, name)[:, :, -len(chunk) :]], 2)
                        if (index, name) in exact
                        else getattr(layer, name)
                    )
                    exact[index, name] = held
                    # with the next forward's own token, the newest RESIDUAL are exact
                    newest = max(SINKS, held.shape[2] - (RESIDUAL - 1))
                    centre = held[:, :, 1:SINKS].mean(2, keepdim=True) if name == "keys" else 0.0
                    rounded = codec.decode(codec.encode(held[:, :, SINKS:newest] - centre)) + centre
                    setattr(layer, name, torch.cat([held[:, :, :SINKS], rounded, held[:, :, newest:]], 2))
    torch.testing.assert_close(torch.stack(logits), torch.stack(reference), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits, per_vector", [(None, 64), (8, 20), (4, 12), (3, 10), (2, 8)])
def test_kv_bytes_count_the_rounded_bytes(bits, per_vector):
    """Tiny heads have 16 numbers: 64 bytes in fp32, 16 + 4 in int8, 8 + 4 in int4, 6 + 4 in int3,
    4 + 4 in int2 (one group's fp16 scale and minimum); rounded caches also hold the ring of the
    first SINKS and newest RESIDUAL in fp32."""
    model = build_tiny("llama")
    with policy_attention(model), torch.inference_mode():
        cache = make_cache(model, KVSpec.of("h2o", budget=10, kv_bits=bits))
        model(_prompt(30), cache=cache)
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    ring = 0 if bits is None else (SINKS + RESIDUAL) * 64
    assert cache.physical_length() == 10
    assert cache.kv_bytes() == layers * 2 * kv_heads * (10 * per_vector + ring)
    assert cache.kv_bytes() == 10 * kv_bytes_per_token(model, kv_bits=bits) + kv_ring_bytes(model, bits)
    decoder = Decoder(model, KVSpec.of("h2o", kv_bits=bits, budget=10), compile="never")
    with policy_attention(model):
        decoder.start([_prompt(30)[0].tolist()], 4)
    assert decoder.state.kv_bytes() == layers * 2 * kv_heads * (11 * per_vector + ring)  # + the token in flight


def test_a_held_conversation_continues_in_its_bits_and_checkpoints_round_trip():
    """A row handed back from the fast path keeps its bytes: continued through the policy cache it
    equals the uninterrupted run; a checkpoint of it loads only into a cache of the same bits."""
    model = build_tiny("llama")
    ids = _prompt(20)[0].tolist()
    whole = generate(model, [ids], 10, KVSpec.of("h2o", kv_bits=4, budget=12), compile="never", eos_token_id=[])
    first = generate(model, [ids], 5, KVSpec.of("h2o", kv_bits=4, budget=12), compile="never", eos_token_id=[])
    decoder = Decoder(model, KVSpec.of("h2o", kv_bits=4, budget=12), compile="never")
    with policy_attention(model):
        decoder.start([ids], 6)
        for token in first.tokens[0][:-1]:
            decoder.step(torch.tensor([token]))
        held = decoder.hand_back(0)
    assert held.kv_bytes() == held.physical_length() * kv_bytes_per_token(model, kv_bits=4) + kv_ring_bytes(model, 4)
    rest = generate(
        model,
        [first.tokens[0][-1:]],
        5,
        KVSpec.of("h2o", kv_bits=4, budget=12),
        compile="never",
        held=[held],
        eos_token_id=[],
    )
    assert first.tokens[0] + rest.tokens[0] == whole.tokens[0]
    copy = make_cache(model, KVSpec.of("h2o", budget=12, kv_bits=4))
    for layer, source in zip(copy.layers, held.layers, strict=True):
        load_layer_state(layer, layer_state(source))
    assert copy.kv_bytes() == held.kv_bytes()
    with pytest.raises(SparsegenError, match="bits"):
        load_layer_state(make_cache(model, KVSpec.of("h2o", budget=12)).layers[0], layer_state(held.layers[0]))
    older = layer_state(held.layers[0])
    older["recent_keys"] = older["recent_keys"][:, :, :RESIDUAL]  # the ring before it kept the first tokens
    with pytest.raises(SparsegenError, match="older sparsegen .* start the stream again") as error:
        load_layer_state(make_cache(model, KVSpec.of("h2o", budget=12, kv_bits=4)).layers[0], older)
    assert "\n" not in str(error.value)


def test_compiled_step_in_4_bits_equals_the_eager_one():
    model = build_tiny("llama")
    ids = _prompt(21).expand(2, -1)
    eager = generate(model, ids, 16, KVSpec.of("h2o", kv_bits=4, budget=12), compile="never", eos_token_id=[])
    compiled = generate(model, ids, 16, KVSpec.of("h2o", kv_bits=4, budget=12), compile="always", eos_token_id=[])
    assert compiled.mode == "compiled" and compiled.tokens == eager.tokens


@pytest.mark.parametrize("rotated, offset", [(True, 0.0), (False, 0.0), (True, 50.0)])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_byte_products_equal_attention_over_the_rows_as_read(bits, dim, rotated, offset):
    """The kernels' products over byte rows (some slots free, each row's first and newest in the
    ring) equal the plain products over `with_residual(decode(rows))` at the live slots, for a
    strided view of the slots too; rotated rows are multiplied by the rotated query and ring, the
    mixed values rotated back; keys held less their row's centre (`offset`: a large constant part)
    have it added back (q.c at every live slot)."""
    from sparsegen.kv.kernels import held_mix, held_scores, kernels_available

    assert kernels_available()  # the machine's compiler builds them; CI has one
    gen = torch.Generator().manual_seed(dim)
    constant = torch.randn(2, 3, 1, dim, generator=gen) * offset
    ring_keys, ring_values = (torch.randn(2, 3, RING_SLOTS, dim, generator=gen) for _ in range(2))
    ring_keys += constant
    centre = row_centre(ring_keys)
    codec = KVCodec.for_dim(bits, dim, rotated)
    keys = codec.encode(torch.randn(2, 3, 90, dim, generator=gen) + constant, centre)
    values = codec.encode(torch.randn(2, 3, 90, dim, generator=gen))
    positions = torch.randperm(100, generator=gen)[:90].expand(2, 3, 90).clone()
    positions[:, :, ::7] = -1  # free slots
    seen = torch.tensor([100, 95]).view(2, 1, 1)
    query, probs = torch.randn(2, 3, 4, dim, generator=gen), torch.rand(2, 3, 4, 90, generator=gen)
    live = (positions >= 0).unsqueeze(2).expand_as(probs)
    probs = torch.where(live, probs, 0.0)  # attention gives free slots nothing
    for part in (slice(0, 90), slice(5, 90)):
        held_keys = with_residual(codec.decode(keys[:, :, part], centre=centre), positions[:, :, part], seen, ring_keys)
        held_values = with_residual(codec.decode(values[:, :, part]), positions[:, :, part], seen, ring_values)
        scores = held_scores(query, keys[:, :, part], codec, positions[:, :, part], seen, ring_keys)
        mixed = held_mix(probs[..., part], values[:, :, part], codec, positions[:, :, part], seen, ring_values)
        expected = torch.where(live[..., part], query @ held_keys.transpose(-1, -2), 0.0)
        torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-3 if offset else 1e-4)  # q.c ~ 400
        torch.testing.assert_close(mixed, probs[..., part] @ held_values, rtol=1e-5, atol=1e-4)


def test_without_the_kernels_the_fast_path_decodes_in_torch_to_the_same_tokens(monkeypatch):
    import sparsegen.decode.handover as handover

    model = build_tiny("llama")
    ids = _prompt(40)
    with_kernels = generate(model, ids, 12, KVSpec.of("h2o", kv_bits=4, budget=16), compile="never")
    monkeypatch.setattr(handover, "kernels_available", lambda: False)
    decoder = Decoder(model, KVSpec.of("h2o", kv_bits=4, budget=16), compile="never")
    without = generate(model, ids, 12, decoder=decoder)
    assert not decoder.state.layers[0].byte_products and without.tokens == with_kernels.tokens


def test_the_quality_benchs_kl_and_nll_are_the_plain_ones_of_each_next_token_distribution():
    """`bench kv-bits --quality` reads the text once per setting: the KL it reports per token is
    sum p_ref (log p_ref - log p) in float64 over both runs' own log-probabilities (0 against
    itself), and the NLL that of the next token."""
    from sparsegen.bench.kv_bits import _read_text

    model, ids = build_tiny("llama"), _prompt(120)[0]  # tokens past the ring's first 16 and newest 32
    full, rounded = KVSpec.of("full"), KVSpec.of("full", kv_bits=2)
    reference, alone = _read_text(model, ids, full, 8), _read_text(model, ids, rounded, 8)
    again, against = _read_text(model, ids, full, 8, reference), _read_text(model, ids, rounded, 8, reference)
    p, q = reference["log_probs"].double(), alone["log_probs"].double()
    torch.testing.assert_close(against["kl"].double(), (p.exp() * (p - q)).sum(-1), rtol=1e-4, atol=1e-6)
    assert float(again["kl"].abs().max()) == 0 and float(against["kl"].mean()) > 1e-6
    torch.testing.assert_close(against["nll"].double(), -q.gather(1, ids[1:, None])[:, 0], rtol=1e-5, atol=1e-5)
