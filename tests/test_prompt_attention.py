"""A prompt read's attention in bf16 on a CPU (`sparsegen::span_attention`, `kv.prompt_attention`)
against causal attention in float64, and sdpa wherever the kernel does not apply."""

import pytest
import torch
from conftest import build_tiny

from sparsegen.decode.reading import read, read_packed
from sparsegen.few_rows import float_rows_op
from sparsegen.kv import make_cache, prompt_attention

pytestmark = pytest.mark.skipif(float_rows_op() is None, reason="the float_rows kernels cannot be built here")


@pytest.fixture(autouse=True)
def without_amx(monkeypatch):
    """The kernel's bf16 path is tested on every CPU: AMX's (where bf16 goes to sdpa) told it has none."""
    monkeypatch.setattr(prompt_attention, "cpu_flags", lambda: frozenset({"avx512_bf16"}))


def span(query, key, value, scaling):
    return torch.ops.sparsegen.span_attention(query, key, value, scaling)


def float64_attention(query, key, value, scaling):
    """Causal attention of the last queries of the keys, every head of a group over its KV head."""
    heads, queries, _ = query.shape
    group, offset = heads // key.shape[0], key.shape[1] - queries
    keys, values = key.double().repeat_interleave(group, 0), value.double().repeat_interleave(group, 0)
    scores = query.double() @ keys.transpose(1, 2) * scaling
    later = torch.arange(key.shape[1])[None] > torch.arange(queries)[:, None] + offset
    return torch.softmax(scores.masked_fill(later, float("-inf")), -1) @ values


def inputs(heads, kv_heads, dim, queries, keys, seed=0, dtype=torch.bfloat16):
    generator = torch.Generator().manual_seed(seed)
    shapes = (heads, queries, dim), (kv_heads, keys, dim), (kv_heads, keys, dim)
    return tuple(torch.randn(shape, generator=generator).to(dtype) for shape in shapes)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "queries", "keys"),
    [
        (9, 3, 64, 256, 256),
        (9, 3, 64, 37, 37),
        (12, 2, 128, 100, 130),
        (4, 4, 16, 1, 5),
        (8, 1, 256, 70, 70),
        (2, 2, 48, 33, 33),
        (4, 2, 32, 65, 200),
    ],
)
def test_the_kernel_equals_causal_attention_in_float64(heads, kv_heads, dim, queries, keys):
    """Query blocks and row tiles cut anywhere, GQA groups of 1-8, head sizes of one to sixteen
    vectors (a tail off the mix's chunk), queries that are the last of more keys; in bf16 within
    what rounding the output and the probabilities to bf16 allows (as torch's bf16 attention
    rounds), in fp32 within fp32 sums."""
    for dtype, tolerance in ((torch.bfloat16, 1 / 128), (torch.float32, 1e-5)):
        query, key, value = inputs(heads, kv_heads, dim, queries, keys, dtype=dtype)
        got = span(query, key, value, dim**-0.5)
        assert got.shape == query.shape and got.dtype == dtype
        exact = float64_attention(query, key, value, dim**-0.5)
        assert ((got.double() - exact).abs() <= exact.abs() * tolerance + tolerance).all()


def test_a_row_depends_only_on_the_keys_it_sees():
    """The first n queries of a span attended with the span's first n keys come out bit for bit
    as in the whole span's call: nothing of a later key reaches an earlier row."""
    query, key, value = inputs(6, 2, 64, 90, 90, seed=1)
    whole = span(query, key, value, 0.125)
    for n in (1, 7, 32, 33, 64):
        cut = span(query[:, :n].contiguous(), key[:, :n].contiguous(), value[:, :n].contiguous(), 0.125)
        assert torch.equal(cut, whole[:, :n])
    query, key, value = inputs(6, 2, 64, 90, 90, seed=1, dtype=torch.float32)
    assert torch.equal(span(query[:, :33], key[:, :33], value[:, :33], 0.125), span(query, key, value, 0.125)[:, :33])


def test_the_kernel_refuses_what_it_cannot_read():
    query, key, value = inputs(4, 2, 64, 8, 8)
    with pytest.raises(RuntimeError, match="all bf16 or all fp32"):
        span(query.float(), key, value, 0.125)
    with pytest.raises(RuntimeError, match="all bf16 or all fp32"):
        span(query.half(), key.half(), value.half(), 0.125)
    with pytest.raises(RuntimeError, match="keys >= queries"):
        span(query, key[:, :4], value[:, :4], 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        span(query[..., :40], key[..., :40], value[..., :40], 0.125)


class Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2


def kernel_calls(action) -> int:
    """How many times `action()` ran the kernel."""
    with torch.profiler.profile() as profile:
        action()
    return sum(event.key == "sparsegen::span_attention" for event in profile.events())


def test_sdpa_or_span_takes_the_kernel_only_where_sdpa_attends_plain_causally():
    """Where it runs, the kernel's output is sdpa's up to rounding; more keys than queries without a
    mask (sdpa's causal is then top-left), a padded, windowed or float mask, fp16, an fp32 span past
    `FLOAT_SPAN_MAX` keys, a gradient or a single query keep sdpa's own call."""
    query, key, value = (t[None] for t in inputs(4, 2, 32, 20, 20))
    got = []
    assert kernel_calls(
        lambda: got.append(prompt_attention.sdpa_or_span(Module(), query, key, value, None, scaling=0.2))
    )
    out, weights = got[0]
    expected = float64_attention(query[0], key[0], value[0], 0.2).transpose(0, 1)[None]
    assert weights is None and out.shape == expected.shape
    assert ((out.double() - expected).abs() <= expected.abs() / 128 + 0.01).all()
    longer = torch.cat([key, key], dim=2), torch.cat([value, value], dim=2)
    padded = torch.ones(1, 1, 20, 40, dtype=torch.bool).tril_(20)
    padded[..., 3] = False
    windowed = torch.ones(1, 1, 20, 40, dtype=torch.bool).tril_(20).triu_(10)
    fp32 = tuple(t.float() for t in (query, key, value))
    long_fp32 = tuple(t.repeat(1, 1, 60, 1) for t in fp32)  # 1,200 queries and keys
    others = [
        lambda: prompt_attention.sdpa_or_span(Module(), query, *longer, None, scaling=0.2),
        lambda: prompt_attention.sdpa_or_span(Module(), query, *longer, padded, scaling=0.2),
        lambda: prompt_attention.sdpa_or_span(Module(), query, *longer, windowed, scaling=0.2),
        lambda: prompt_attention.sdpa_or_span(Module(), query, *longer, padded.tril(20).float(), scaling=0.2),
        lambda: prompt_attention.sdpa_or_span(Module(), query.half(), key.half(), value.half(), None),
        lambda: prompt_attention.sdpa_or_span(Module(), *long_fp32, None),
        lambda: prompt_attention.sdpa_or_span(Module(), query[:, :, :1], key[:, :, :1], value[:, :, :1], None),
    ]
    for other in others:
        assert kernel_calls(other) == 0
    assert kernel_calls(lambda: prompt_attention.sdpa_or_span(Module(), *fp32, None))
    with torch.enable_grad():
        leaf = query.clone().requires_grad_()
        assert kernel_calls(lambda: prompt_attention.sdpa_or_span(Module(), leaf, key, value, None)) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_chunk_after_held_keys_takes_the_kernel_under_its_causal_mask(dtype):
    """A chunk's queries as the last of more keys, under transformers' boolean bottom-right causal
    mask (batch rows broadcast), give causal attention in float64 through the kernel."""
    query, key, value = (t[None].repeat(2, 1, 1, 1) for t in inputs(4, 2, 32, 24, 70, seed=3, dtype=dtype))
    mask = torch.ones(2, 1, 24, 70, dtype=torch.bool).tril_(70 - 24)
    got = []
    assert kernel_calls(
        lambda: got.append(prompt_attention.sdpa_or_span(Module(), query, key, value, mask, scaling=0.2)[0])
    )
    exact = float64_attention(query[1], key[1], value[1], 0.2).transpose(0, 1)
    tolerance = 1 / 128 if dtype == torch.bfloat16 else 1e-5
    assert ((got[0][1].double() - exact).abs() <= exact.abs() * tolerance + tolerance).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_a_bf16_model_reads_prompts_through_the_kernel_as_its_own_forward(arch):
    """A tiny bf16 model's prompt read (alone, packed with others, and in chunks of 8 after the keys
    its cache holds) runs the kernel in every layer and gives the last logits of its own sdpa
    forward, outside policy attention, up to bf16 rounding."""
    model = build_tiny(arch).to(torch.bfloat16)
    prompts = [[5 + (i * 7 + j) % 90 for j in range(n)] for i, n in enumerate((40, 17, 33))]
    with torch.no_grad():
        own = torch.stack([model(torch.tensor([ids])).logits[0, -1].float() for ids in prompts])
    alone = []
    calls = kernel_calls(lambda: alone.extend(read(model, ids, make_cache(model, "full")).float() for ids in prompts))
    assert calls == len(prompts) * model.config.num_hidden_layers
    packed = read_packed(model, prompts, [make_cache(model, "full") for _ in prompts])
    chunked = []
    in_chunks = (read(model, ids, make_cache(model, "full"), chunk=8) for ids in prompts)
    calls = kernel_calls(lambda: chunked.extend(in_chunks))
    many = sum(len(ids[start : start + 8]) > 1 for ids in prompts for start in range(0, len(ids), 8))
    assert calls == many * model.config.num_hidden_layers  # a chunk of one token is a decode step's
    scale = own.abs().max()
    for logits in (torch.stack(alone), packed, torch.stack(chunked).float()):
        assert (logits - own).abs().max() <= 0.03 * scale


def test_with_amx_bf16_prompts_keep_sdpa_and_fp32_ones_the_kernel(monkeypatch):
    """Where the CPU has AMX, torch's flash attention multiplies bf16 on its tiles (2x the kernel):
    a bf16 prompt keeps sdpa's own call (its result sdpa's, bit for bit), an fp32 one the kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(prompt_attention, "cpu_flags", lambda: frozenset({"amx_bf16", "avx512_bf16"}))
    query, key, value = (t[None] for t in inputs(4, 2, 32, 20, 20))
    got = []
    assert kernel_calls(lambda: got.append(prompt_attention.sdpa_or_span(Module(), query, key, value, None))) == 0
    assert torch.equal(got[0][0], sdpa_attention_forward(Module(), query, key, value, None)[0])
    fp32 = tuple(t.float() for t in (query, key, value))
    assert kernel_calls(lambda: prompt_attention.sdpa_or_span(Module(), *fp32, None))
