"""Rotated KV bits: the rotation, 3- and 2-bit packing, and rotated rows on every path.

References are independent of the codec: the Hadamard matrix from its closed form, the rounding
and the packing in plain Python / float64, and the fast path against the drop-in cache.
"""

import math

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.errors import SparsegenError
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.quantized import BITS, KVCodec, pack, rotation, unpack
from sparsegen.kv.spec import KVSpec
from tests.codec_reference import round_trip_reference
from tests.conftest import build_tiny
from tests.kv_reference import TABLE, generate_drop_in

DIMS = [16, 64, 80, 96, 128]


def _hadamard_entry(i: int, j: int, block: int) -> float:
    """Sylvester's normalised Hadamard matrix, block-diagonal: (-1)^popcount(i & j) / sqrt(block)."""
    if i // block != j // block:
        return 0.0
    return (-1) ** bin((i % block) & (j % block)).count("1") / math.sqrt(block)


@pytest.mark.parametrize("dim", DIMS)
def test_rotation_is_an_orthogonal_signed_hadamard_matrix(dim):
    r = rotation(dim).double()
    torch.testing.assert_close(r @ r.T, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-6)
    block = dim & -dim
    assert block == (dim if dim in (16, 64, 128) else 16 if dim == 80 else 32)
    signs = [1.0 if r[i, i // block * block] > 0 else -1.0 for i in range(dim)]
    expected = [[signs[i] * _hadamard_entry(i, j, block) for j in range(dim)] for i in range(dim)]
    torch.testing.assert_close(r, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-7)
    assert 0.25 * dim < signs.count(-1.0) < 0.75 * dim  # the signs are mixed, not all one


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [16, 64, 96, 128])
def test_rotated_codec_equals_a_float64_reference(bits, dim):
    codec = KVCodec.for_dim(bits, dim)
    assert codec.rotated  # the default
    x = torch.randn(2, 3, 40, dim, generator=torch.Generator().manual_seed(bits * dim)) * 3
    back = codec.decode(codec.encode(x)).double()
    expected = round_trip_reference(x, bits, codec.group, rotation(dim).double())
    # float32 against float64 may put a value on the other side of a rounding boundary: one step
    step = (x.double() @ rotation(dim).double()).abs().amax() * 2 / ((1 << bits) - 1)
    error = (back - expected).abs()
    assert float(error.max()) <= float(step) and float((error > 1e-3).double().mean()) < 0.01


@pytest.mark.parametrize("bits", [4, 3, 2])
def test_rotation_shrinks_the_error_of_vectors_with_outlier_channels(bits):
    """Keys carry a few large channels; spread over the vector, they no longer widen one group."""
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(bits), dtype=torch.float64)
    x[:, [3, 40]] *= 20
    errors = {}
    for rotated in (False, True):
        codec = KVCodec.for_dim(bits, 64, rotated=rotated)
        errors[rotated] = float((codec.decode(codec.encode(x.float())).double() - x).square().mean())
    # at 2 bits the clipped range (CLIPS) already spends the 4 levels on the bulk, not the outliers,
    # unrotated too: rotation still wins, by less (0.72 against 0.78 here)
    assert errors[True] < (0.7 if bits > 2 else 0.97) * errors[False]


def _plain_pack(codes: list[int], bits: int) -> list[int]:
    """A row's codes as one little-endian bit stream, code j at bit j * bits."""
    stream = sum(code << (bits * j) for j, code in enumerate(codes))
    return list(stream.to_bytes(len(codes) * bits // 8, "little"))


@pytest.mark.parametrize("bits", BITS)
def test_packing_equals_a_plain_python_bit_packer(bits):
    codes = torch.randint(0, 1 << bits, (5, 64), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 64 * bits // 8)
    assert packed.tolist() == [_plain_pack(row, bits) for row in codes.tolist()]
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dim", [8, 16, 24, 64, 80, 96, 128, 256])
def test_width_and_dim_of_are_exact_inverses(bits, dim):
    codec = KVCodec.for_dim(bits, dim)
    assert codec.width(dim) == dim * bits // 8 + dim // codec.group * 4
    assert codec.dim_of(codec.width(dim)) == dim
    assert codec.encode(torch.randn(2, dim)).shape == (2, codec.width(dim))


def test_a_head_dim_the_packing_cannot_split_gets_a_one_line_error():
    with pytest.raises(SparsegenError, match="head dim 20") as error:
        KVCodec.for_dim(3, 20)
    assert "\n" not in str(error.value)
    assert KVCodec(4, 16) != KVCodec(4, 16, rotated=False)  # part of the codec's identity


def _prompt(length: int) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_drop_in_cache_and_fast_path_agree_in_rotated_bits(policy, bits):
    model = build_tiny("llama", attn="eager")
    ids = _prompt(40)
    small = TABLE[policy].small
    reference = generate_drop_in(model, ids, make_cache(model, KVSpec.of(policy, kv_bits=bits, **small)), 20)
    decoder = Decoder(model, KVSpec.of(policy, kv_bits=bits, **small), compile="never")
    out = generate(model, ids, 20, decoder=decoder)
    assert out.tokens[0] == reference
    assert decoder.state.layers[0].codec.rotated
    assert decoder.state.layers[0].byte_products == (bits in (8, 4))  # 3 and 2 bits decode in torch


HOLDING_ROUNDED = {"streaming": {"sinks": 4, "recent": 60}, "h2o": {"heavy": 30, "recent": 30}}
"""Budgets that hold tokens past a row's first 16 and newest 32 (the ring's, read at full precision)."""


def _teacher_forced_logits(model, ids: list[int], policy: str, bits: int | None) -> torch.Tensor:
    decoder = Decoder(model, KVSpec.of(policy, kv_bits=bits, **HOLDING_ROUNDED[policy]), compile="never")
    with policy_attention(model), torch.inference_mode():
        logits = [decoder.start([ids[:40]], 64)[0]]
        for token in ids[40:-1]:
            logits.append(decoder.step(torch.tensor([token]))[0])
    return torch.stack(logits)


@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_fewer_bits_stay_close_to_full_precision_kv(policy):
    """Token by token past the ring, the logits with rotated KV stay near those with fp32 KV under
    eager attention, nearer the more bits."""
    model = build_tiny("llama", attn="eager")
    ids = _prompt(120)[0].tolist()
    exact = _teacher_forced_logits(model, ids, policy, None)
    scale = float(exact.std())
    errors = [float((_teacher_forced_logits(model, ids, policy, bits) - exact).abs().mean()) for bits in BITS]
    assert errors == sorted(errors) and errors[0] < 0.01 * scale and errors[-1] < 0.5 * scale


def test_compiled_step_in_rotated_3_bits_equals_the_eager_one():
    model = build_tiny("llama")
    ids = _prompt(21).expand(2, -1)
    eager = generate(model, ids, 8, KVSpec.of("h2o", kv_bits=3, budget=12), compile="never", eos_token_id=[])
    compiled = generate(model, ids, 8, KVSpec.of("h2o", kv_bits=3, budget=12), compile="always", eos_token_id=[])
    assert compiled.mode == "compiled" and compiled.tokens == eager.tokens


def test_a_checkpoint_loads_only_into_a_cache_of_the_same_rotation():
    import dataclasses

    from sparsegen.kv.policy_cache import layer_state, load_layer_state

    model = build_tiny("llama")
    cache = make_cache(model, KVSpec.of("h2o", budget=12, kv_bits=4))
    with policy_attention(model), torch.inference_mode():
        model(_prompt(20), cache=cache)
    state = layer_state(cache.layers[0])
    assert state["kv_rotated"] is True
    plain = make_cache(model, KVSpec.of("h2o", budget=12, kv_bits=4)).layers[0]
    plain.codec = dataclasses.replace(plain.codec, rotated=False)
    with pytest.raises(SparsegenError, match="4 bits, rotated, this cache in 4 bits$"):
        load_layer_state(plain, state)
    load_layer_state(make_cache(model, KVSpec.of("h2o", budget=12, kv_bits=4)).layers[0], state)
