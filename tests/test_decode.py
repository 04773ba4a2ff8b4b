"""The fast decode path equals the policy cache under transformers' generate(), row by row."""

import pytest
import torch

from sparsegen.decode import Decoder, generate
from sparsegen.errors import SparsegenError
from sparsegen.kv import make_cache
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny
from tests.kv_reference import TABLE, generate_drop_in

SMALL = {name: row.small for name, row in TABLE.items()}


def _reference(model, ids, policy, budget, new, position=None):
    """transformers' generate() over the policy cache: the eager engine the fast path must equal."""
    return generate_drop_in(model, ids, make_cache(model, KVSpec.of(policy, position=position, **budget)), new)


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 96, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", list(SMALL))
def test_fast_path_equals_generate_per_policy(arch, policy):
    model = build_tiny(arch)
    ids = _prompt(21)
    for position in ("original", "rolling"):
        ref = _reference(model, ids, policy, SMALL[policy], 24, position)
        out = generate(model, ids, 24, KVSpec.of(policy, position=position, **SMALL[policy]), compile="never")
        assert out.tokens[0] == ref, (policy, position)


def test_teacher_forced_logits_match_the_dense_forward(arch):
    """Fed a fixed continuation, every step's logits equal one dense forward over the whole text."""
    model = build_tiny(arch)
    ids = _prompt(30)[0].tolist()
    decoder = Decoder(model, "full", compile="never")
    with policy_attention(model):  # a Decoder driven by hand runs inside the scope generate() enters
        logits = [decoder.start([ids[:12]], 32)[0]]
        for token in ids[12:-1]:
            logits.append(decoder.step(torch.tensor([token]))[0])
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0, 11:-1]
    torch.testing.assert_close(torch.stack(logits), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("policy", list(SMALL))
def test_padded_batch_rows_equal_single_rows(policy):
    """Left-padded rows of different lengths: each row is its single-row run (padding never enters
    a cache, never counts as a sink, heavy hitter or recent token)."""
    model = build_tiny("llama")
    lengths = [9, 23, 16, 23]
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = _prompt(length, seed=row)[0]
        mask[row, width - length :] = 1
    budget = {**SMALL[policy]}
    batch = generate(model, ids, 20, KVSpec.of(policy, **budget), attention_mask=mask, compile="never", eos_token_id=[])
    for row, length in enumerate(lengths):
        single = generate(
            model, _prompt(length, seed=row), 20, KVSpec.of(policy, **budget), compile="never", eos_token_id=[]
        )
        assert batch.tokens[row] == single.tokens[0], (policy, row)


def test_ratio_budgets_differ_per_row():
    """A budget given as a share of the prompt resolves per row: short and long rows each evict
    to their own size, and still equal their single-row runs."""
    model = build_tiny("qwen2")
    prompts = [_prompt(10, 3)[0].tolist(), _prompt(30, 4)[0].tolist()]
    batch = generate(model, prompts, 16, KVSpec.of("h2o", heavy=0.3, recent=0.3), compile="never", eos_token_id=[])
    for row, prompt in enumerate(prompts):
        single = generate(
            model, [prompt], 16, KVSpec.of("h2o", heavy=0.3, recent=0.3), compile="never", eos_token_id=[]
        )
        assert batch.tokens[row] == single.tokens[0]


def test_sampling_rows_equal_single_rows_with_the_same_seed():
    model = build_tiny("mistral")
    prompts = [_prompt(7, 5)[0].tolist(), _prompt(13, 6)[0].tolist()]
    options = dict(kv=KVSpec.of("streaming", sinks=2, recent=6), temperature=0.9, top_p=0.8, seed=11, compile="never")
    batch = generate(model, prompts, 15, eos_token_id=[], **options)
    singles = [generate(model, [p], 15, eos_token_id=[], **options).tokens[0] for p in prompts]
    assert batch.tokens == singles
    other_seed = generate(model, prompts, 15, eos_token_id=[], **{**options, "seed": 12})
    assert other_seed.tokens != batch.tokens  # the seed is honoured


def test_top_p_keeps_only_the_nucleus():
    from sparsegen.decode import choose

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(choose(logits, 1.0, 0.7, [torch.Generator().manual_seed(s)])) for s in range(200)}
    assert draws == {0, 1}


def test_rows_stop_at_eos():
    model = build_tiny("llama")
    ids = _prompt(12)
    free = generate(model, ids, 12, compile="never", eos_token_id=[]).tokens[0]
    stop = free[4]
    out = generate(model, ids, 12, compile="never", eos_token_id=stop).tokens[0]
    assert out == free[: free.index(stop) + 1]


def test_rows_that_end_leave_the_batch_and_the_rest_decode_as_alone(monkeypatch):
    """Ended rows stop being read (the batch shrinks), and every row, greedy or drawn with its own
    generator, still makes its single run's tokens."""
    model = build_tiny("llama")
    prompts = [_prompt(9 + row, seed=row)[0].tolist() for row in range(4)]
    options = dict(kv=KVSpec.of("h2o", heavy=4, recent=4), compile="never")
    widths = []
    step = Decoder.step
    monkeypatch.setattr(Decoder, "step", lambda self, tokens: widths.append(self.rows) or step(self, tokens))
    for sampling in ({}, {"temperature": 0.1, "seed": 3}):
        free = [generate(model, [p], 12, eos_token_id=[], **options, **sampling).tokens[0] for p in prompts]
        stop = next(t for t in free[0] if all(t not in row for row in free[1:]))  # only row 0 makes it
        widths.clear()
        batch = generate(model, prompts, 12, eos_token_id=stop, **options, **sampling).tokens
        assert widths[0] == 4 and min(widths) < 4
        assert batch == [generate(model, [p], 12, eos_token_id=stop, **options, **sampling).tokens[0] for p in prompts]
        assert batch[0][-1] == stop and max(len(row) for row in batch) > len(batch[0])


def test_compiled_step_equals_eager_engine():
    model = build_tiny("llama")
    ids = _prompt(21)
    for policy in ("full", "h2o", "triattention"):  # triattention: RoPE's angles inside the graph
        ref = _reference(model, ids, policy, SMALL[policy], 12)
        out = generate(model, ids, 12, KVSpec.of(policy, **SMALL[policy]), compile="always")
        assert out.mode == "compiled" and out.compile_s > 0
        assert out.tokens[0] == ref


def test_short_generations_and_missing_compilers_run_eager_and_say_so(monkeypatch):
    model = build_tiny("llama")
    said = []
    decoder = Decoder(model, KVSpec.of("streaming", sinks=2, recent=6), compile="auto", notify=said.append)
    out = generate(model, _prompt(8), 5, decoder=decoder)
    assert out.mode == "eager" and said == ["decoding eagerly: 5 new tokens do not pay for compiling the step"]
    monkeypatch.setattr("shutil.which", lambda name: None)
    said.clear()
    generate(model, _prompt(8), 80, decoder=Decoder(model, "full", notify=said.append), eos_token_id=[])
    assert said == ["decoding eagerly: no C++ compiler found for torch.compile"]


def test_auto_compiles_only_once_a_generation_has_run_long_enough(monkeypatch):
    model = build_tiny("llama")
    ids = _prompt(9)
    ref = generate(model, ids, 14, compile="never", eos_token_id=[]).tokens
    monkeypatch.setattr("sparsegen.decode.engine.COMPILE_AFTER", 4)
    monkeypatch.setattr("sparsegen.decode.engine.COMPILE_PAYS_AFTER", 6)
    said = []
    short = generate(model, ids, 9, eos_token_id=[], notify=said.append)
    assert short.mode == "eager" and said == ["decoding eagerly: 9 new tokens do not pay for compiling the step"]
    said.clear()
    long = generate(model, ids, 14, eos_token_id=[], notify=said.append)
    assert long.mode == "compiled" and long.tokens == ref
    assert said[-1].startswith("compiled the decode step in") and "after 4 eager steps" in said[-1]


def test_a_failing_compiler_falls_back_to_the_eager_step(monkeypatch):
    model = build_tiny("llama")
    ids = _prompt(10)
    ref = generate(model, ids, 6, compile="never").tokens

    def broken(fn, **options):
        def run(*args):
            raise RuntimeError("no compiler today")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    said = []
    out = generate(model, ids, 6, decoder=Decoder(model, compile="always", notify=said.append))
    assert out.mode == "eager" and out.tokens == ref
    assert said and "compiling the step failed (RuntimeError: no compiler today)" in said[0]


def test_bad_input_gets_one_line_errors():
    model = build_tiny("llama")
    with pytest.raises(SparsegenError, match="at least one token"):
        generate(model, [[]], 4, compile="never")
    with pytest.raises(SparsegenError, match="compile must be one of"):
        Decoder(model, compile="sometimes")
    with pytest.raises(SparsegenError, match="max_new_tokens"):
        generate(model, _prompt(4), 0)


def test_bf16_cache_and_weights_stay_close_to_fp32():
    model = build_tiny("llama")
    ids = _prompt(24)[0].tolist()

    def forced(decoder):
        with policy_attention(decoder.model):
            rows = [decoder.start([ids[:8]], 16)[0]]
            rows += [decoder.step(torch.tensor([token]))[0] for token in ids[8:-1]]
        return torch.stack(rows)

    ref = forced(Decoder(model, compile="never"))
    scale = ref.abs().max()
    low_kv = forced(Decoder(model, compile="never", kv_dtype=torch.bfloat16))
    assert not torch.equal(low_kv, ref)  # the cache really is stored in bf16
    assert (low_kv - ref).abs().max() < 0.02 * scale
    low_weights = forced(Decoder(model.to(torch.bfloat16), compile="never"))
    assert low_weights.dtype == torch.float32 and (low_weights - ref).abs().max() < 0.1 * scale


def test_each_row_holds_at_most_its_budget_in_fixed_buffers():
    model = build_tiny("qwen2")
    decoder = Decoder(model, KVSpec.of("streaming_h2o", sinks=2, heavy=3, recent=4), compile="never")
    with policy_attention(model):
        logits = decoder.start([_prompt(5, 1)[0].tolist(), _prompt(20, 2)[0].tolist()], 30)
        buffers = decoder.state.kv_bytes()
        assert decoder.state.live_tokens().tolist() == [5, 9]
        for _ in range(29):
            logits = decoder.step(logits.argmax(-1))
            assert decoder.state.live_tokens().max() <= 9
    assert decoder.state.live_tokens().tolist() == [9, 9] and decoder.state.kv_bytes() == buffers


def test_the_fast_path_refuses_to_step_without_sparsegens_attention():
    """Outside policy_attention the model's own sdpa would ignore the `attention_engine` and attend
    over one token: the step says so in one line instead of decoding garbage."""
    model = build_tiny("llama")
    decoder = Decoder(model, KVSpec.of("streaming", sinks=2, recent=6), compile="never")
    with policy_attention(model):
        logits = decoder.start([_prompt(8)[0].tolist()], 4)
        decoder.step(logits.argmax(-1))
    with pytest.raises(SparsegenError, match=r"^the model's attention is 'sdpa'.*policy_attention\(model\)"):
        decoder.step(logits.argmax(-1))


def test_generate_leaves_the_model_as_given():
    """Compiling patches the Linear layers' forward and policies switch the attention implementation;
    generate() undoes what it did, make_cache changes nothing, policy_attention undoes its switch on
    exit and restore_linears what use_gemv did."""
    from sparsegen.few_rows import restore_linears, use_gemv

    model = build_tiny("llama")
    before = model.config._attn_implementation
    out = generate(model, [list(range(3, 19))], 4, compile="always", eos_token_id=[])
    assert out.mode == "compiled"
    assert not any("forward" in m.__dict__ for m in model.modules())
    patched = use_gemv(model)
    assert patched and all("forward" in m.__dict__ for m in patched)
    restore_linears(patched)
    assert not any("forward" in m.__dict__ for m in model.modules())
    make_cache(model, KVSpec.of("streaming", budget=8))
    assert model.config._attn_implementation == before
    with policy_attention(model):
        assert model.config._attn_implementation != before
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) == model.config.num_hidden_layers
    assert model.config._attn_implementation == before
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_step_compiled_for_varying_rows_never_recompiles_and_equals_eager():
    """Rows of different lengths join (the slots grow), leave, and two rows step after one left, on a
    `rows_vary` decoder holding its KV in 4 bits (the byte kernels inside the graph): two graphs
    in all, the eager logits."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # graphs an earlier test compiled for the step (another KV) change what gets compiled here
    model = build_tiny("llama", layers=2)  # two layers: a second layer's index, two thirds of the cold compile
    joins = [[list(range(3, 12))], [list(range(5, 19)), list(range(7, 21))], [list(range(4, 90))]]
    outputs = {}
    for mode in ("never", "always"):
        graphs = counters["stats"]["unique_graphs"]
        decoder = Decoder(model, KVSpec.of("full", kv_bits=4), compile=mode, rows_vary=True, notify=lambda _: None)
        logits, seen, slots = None, [], []
        with policy_attention(model):
            for prompts in joins:
                caches, joined = decoder.prefill(prompts)
                decoder.join([cache for _, cache in caches], 6)
                slots.append(decoder.state.layers[0].keys.shape[2])
                logits = joined if logits is None else torch.cat([logits, joined])
                for _ in range(3):
                    logits = decoder.step(logits.argmax(-1))
                    seen.append(logits)
                if decoder.rows == 3:
                    logits = logits[decoder.leave([0])]
                    logits = decoder.step(logits.argmax(-1))  # two rows step after one left
                    seen.append(logits)
        assert slots[0] < slots[2]  # the last join brought a row longer than the slots held: they grew
        outputs[mode] = seen
        if mode == "always":
            assert counters["stats"]["unique_graphs"] - graphs == 2  # one row; any other count
    for eager, compiled in zip(outputs["never"], outputs["always"], strict=True):
        torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("policy", ["full", "h2o"])
def test_rows_leaving_and_joining_move_only_their_own_rows_and_decode_as_alone(policy):
    """Rows leave from the middle (the last staying rows take their places, the buffers keep
    their storage) and a row joins into the room they left: every row's greedy tokens are its own
    run's alone, whatever its index in the batch."""
    model = build_tiny("llama", layers=2)
    prompts = [list(range(3, 3 + n)) for n in (9, 14, 11, 20)] + [list(range(30, 47))]

    def alone(prompt: list[int], steps: int) -> list[int]:
        out = generate(model, [prompt], steps + 1, KVSpec.of(policy, budget=12), compile="never", eos_token_id=[])
        return out.tokens[0]

    decoder = Decoder(model, KVSpec.of(policy, budget=12), compile="never", rows_vary=True, notify=lambda _: None)
    tokens = {row: [] for row in range(5)}
    with policy_attention(model):
        caches, logits = decoder.prefill(prompts[:4])
        decoder.start_from(caches, 8)
        batch = [0, 1, 2, 3]
        for step in range(6):
            for row, token in zip(batch, logits.argmax(-1).tolist(), strict=True):
                tokens[row].append(token)
            if step == 1:
                buffer = decoder.state.layers[0].keys
                order = decoder.leave([0, 2])
                assert order == [3, 1] and decoder.state.layers[0].keys.data_ptr() == buffer.data_ptr()
                batch, logits = [batch[row] for row in order], logits[order]
            if step == 3:
                caches, joined = decoder.prefill(prompts[4:])
                decoder.join([cache for _, cache in caches], 8)
                assert decoder.state.layers[0].keys.data_ptr() == buffer.data_ptr()  # into the room rows left
                batch, logits = [*batch, 4], torch.cat([logits, joined])
                tokens[4].append(int(joined.argmax(-1)))
            logits = decoder.step(logits.argmax(-1))
    for row in (1, 3, 4):
        assert tokens[row] == alone(prompts[row], len(tokens[row]) - 1)[: len(tokens[row])]


def test_decoders_past_dynamos_graph_limit_still_compile_and_equal_eager():
    """Every decoder compiles the same code, and dynamo steps a code eagerly past its graph limit
    (8): a process already holding graphs of other decoders (here, a limit of one) still compiles
    each new decoder's step, which equals the eager one."""
    from torch._dynamo.utils import counters

    prompt = [list(range(3, 17))]
    for arch, spec in (("llama", KVSpec.of("full")), ("qwen2", KVSpec.of("h2o", budget=10))):
        model = build_tiny(arch, layers=2)
        eager = generate(model, prompt, 8, spec, compile="never", eos_token_id=[])
        graphs = counters["stats"]["unique_graphs"]
        with torch._dynamo.config.patch(recompile_limit=1):  # pytest's monkeypatch would delete it after
            compiled = generate(model, prompt, 8, spec, compile="always", eos_token_id=[])
        assert counters["stats"]["unique_graphs"] > graphs, arch  # compiled, not stepped eagerly
        assert compiled.tokens == eager.tokens, arch


def test_a_reused_decoder_counts_only_the_compile_time_of_the_call_that_compiled():
    model = build_tiny("llama")
    decoder = Decoder(model, compile="always", notify=lambda _: None)
    first = generate(model, [list(range(3, 19))], 6, decoder=decoder, eos_token_id=[])
    second = generate(model, [list(range(3, 19))], 6, decoder=decoder, eos_token_id=[])
    assert first.compile_s > 0 and second.compile_s == 0
    assert second.decode_steps == first.decode_steps + 1 and second.decode_s > 0  # every step of this call timed
    decoder.release()


def test_bf16_rows_step_through_the_bf16_kernel_as_the_model_reads_them():
    """A bf16 model's eager steps take the few-row kernel over bf16 panels (`few_rows`); three
    rows fed the same tokens as one forward of the whole text stay within bf16's rounding of it."""
    model = build_tiny("llama").to(torch.bfloat16)
    ids = torch.cat([_prompt(16), _prompt(16) + 1, _prompt(16) + 2])
    decoder = Decoder(model, compile="never")
    with policy_attention(model):
        steps = [decoder.start(ids[:, :8].tolist(), 8)]
        steps += [decoder.step(ids[:, position]) for position in range(8, 15)]
    assert {panels.dtype for panels in decoder.packed.values()} == {torch.bfloat16}
    got = torch.stack(steps, dim=1).float()
    with torch.no_grad():
        expected = model(ids[:, :15]).logits[:, 7:].float()
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()
