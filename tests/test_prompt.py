import json

import pytest
import torch

from sparsegen.errors import SparsegenError
from sparsegen.eval.perplexity import prompted_ppl, windowed_ppl
from sparsegen.kv import POLICIES
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.prompt import PromptTraining, SoftPrompt, prompt_loss, train_prompt
from sparsegen.prompt.prompted import PromptedModel
from sparsegen.prompt.train import STATE
from tests.conftest import build_tiny


def _samples(n=6, seqlen=24, seed=0):
    return torch.randint(3, 96, (n, seqlen), generator=torch.Generator().manual_seed(seed))


def _reference_greedy(model, prompt, ids, steps):
    """Greedy decoding recomputing everything, the prompt's embeddings before the text each step."""
    seq = ids
    with torch.no_grad():
        for _ in range(steps):
            embeds = prompt.prepend(model.get_input_embeddings()(seq))
            seq = torch.cat([seq, model(inputs_embeds=embeds).logits[:, -1:].argmax(-1)], 1)
    return seq


def test_training_lowers_the_loss_and_leaves_the_model_alone(tmp_path):
    model = build_tiny("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    samples = _samples() % 6 + 3  # text over 6 of the 96 tokens: a prompt can learn to expect them
    start = SoftPrompt.from_vocabulary(model, 8)  # the initial prompt of the run below (same seed)
    with torch.no_grad():
        initial = sum(prompt_loss(model, start, samples[i : i + 1]).item() for i in range(6))
    prompt, report = train_prompt(
        model, samples, tmp_path / "p", PromptTraining(tokens=8, steps=40, lr=0.1), progress=False
    )
    with torch.no_grad():
        final = sum(prompt_loss(model, prompt, samples[i : i + 1]).item() for i in range(6))
    assert final < 0.95 * initial
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert (tmp_path / "p" / "loss.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "p" / "training.json").read_text())["losses"]) == 40


def test_an_interrupted_run_resumes_to_the_same_prompt(tmp_path):
    model, samples = build_tiny("qwen2"), _samples()
    settings = PromptTraining(tokens=3, steps=8, lr=1e-2, checkpoint_every=4)
    straight, _ = train_prompt(model, samples, tmp_path / "a", settings, progress=False)
    train_prompt(model, samples, tmp_path / "b", PromptTraining(**{**settings.__dict__, "steps": 4}), progress=False)
    assert (tmp_path / "b" / STATE).exists()
    resumed, report = train_prompt(model, samples, tmp_path / "b", settings, progress=False)
    assert len(report.losses) == 8
    torch.testing.assert_close(resumed.embeddings, straight.embeddings, rtol=0, atol=0)


def test_saved_prompt_reloads_to_identical_logits_and_peft_reads_it(tmp_path):
    from peft import PeftModel

    model = build_tiny("mistral")
    prompt = SoftPrompt(torch.randn(5, 64) * 0.02)
    prompt.save(tmp_path / "p", model)
    loaded = SoftPrompt.load(tmp_path / "p", model)
    ids = _samples(1, 10)
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        ours = model(inputs_embeds=loaded.prepend(embeds)).logits
        torch.testing.assert_close(ours, model(inputs_embeds=prompt.prepend(embeds)).logits, rtol=0, atol=0)
        theirs = PeftModel.from_pretrained(build_tiny("mistral"), tmp_path / "p").eval()(input_ids=ids).logits
    torch.testing.assert_close(theirs[:, -10:], ours[:, -10:], rtol=1e-5, atol=1e-5)


def test_prompted_perplexity_without_a_prompt_is_windowed_perplexity():
    model, ids = build_tiny("gemma3"), _samples(1, 100)[0]
    ours = prompted_ppl(model, None, ids, 25)
    assert ours.ppl == pytest.approx(windowed_ppl(model, ids, 25, progress=False).ppl, rel=1e-6)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_cached_prompt_generation_equals_recomputing_it_and_is_never_evicted(policy):
    model = build_tiny("llama")
    prompt = SoftPrompt.from_vocabulary(model, 5, seed=1)
    ids = _samples(1, 12, seed=3)
    expected = _reference_greedy(model, prompt, ids, 16)
    roomy = PromptedModel(model, prompt, KVSpec.of(policy, **({} if policy == "full" else {"budget": 64})))
    assert torch.equal(roomy.generate(ids, max_new_tokens=16), expected)
    if policy == "full":
        return
    tight = PromptedModel(model, prompt, KVSpec.of(policy, budget=8))
    cache = tight.cache()
    placeholder = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    if POLICIES[policy].reconstructs:  # it re-reads token ids, and a soft prompt has none: a clear error
        with pytest.raises(SparsegenError, match="scores the prompt by re-reading it"), policy_attention(model):
            model.generate(placeholder, cache=cache, max_new_tokens=16, do_sample=False, pad_token_id=0)
        return
    with policy_attention(model):
        model.generate(placeholder, cache=cache, max_new_tokens=16, do_sample=False, pad_token_id=0)
    for layer in cache.policy_layers():
        assert all(kept[:5] == [0, 1, 2, 3, 4] for heads in layer.kept_positions() for kept in heads)
        assert layer.tokens_per_head <= 8 + 5 + 16 * POLICIES[policy].prefill_only


def test_bad_prompts_are_clear_errors(tmp_path):
    model = build_tiny("llama")
    SoftPrompt(torch.zeros(3, 32)).save(tmp_path / "narrow", build_tiny("llama"))
    with pytest.raises(SparsegenError, match="hidden size is 64: it was trained for another model"):
        SoftPrompt.load(tmp_path / "narrow", model)
    with pytest.raises(SparsegenError, match="not a soft-prompt folder"):
        SoftPrompt.load(tmp_path, model)
    (tmp_path / "narrow" / "adapter_model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(SparsegenError, match="truncated"):
        SoftPrompt.load(tmp_path / "narrow", model)
    with pytest.raises(SparsegenError, match="at least one virtual token"):
        SoftPrompt.from_vocabulary(model, 0)
    with pytest.raises(SparsegenError, match="distillation needs a teacher"):
        train_prompt(model, _samples(), tmp_path / "x", PromptTraining(distill=0.5), progress=False)


def test_bench_compress_prompt_on_a_tiny_model(tiny_folder, tiny_text, tmp_path):
    from sparsegen.bench.compress_prompt import VARIANTS, bench_compress_prompt

    options = dict(
        steps=3, tokens=2, seqlen=16, n_train=4, eval_windows=2, group_size=32, calib_samples=2, calib_seqlen=16
    )
    run = lambda: bench_compress_prompt(  # noqa: E731
        str(tiny_folder),
        str(tiny_text),
        str(tiny_text),
        zeroshot_limit=0,
        out=tmp_path,
        progress=lambda m: None,
        **options,
    )
    rows = run()
    assert [row["variant"] for row in rows] == [v.name for v in VARIANTS]
    by_name = {row["variant"]: row for row in rows}
    assert by_name["dense"]["bits"] == 16 and by_name["int4 (RTN)"]["bits"] == pytest.approx(4 + 20 / 32)
    assert by_name["50% + int4"]["sparse_bits"] < by_name["50% + int4"]["bits"]
    label = f"{tiny_text} (last 10%) plain"
    assert by_name["50% + int4"][label] != by_name["dense"][label]
    assert json.loads((tmp_path / "prompt" / "training.json").read_text())["losses"]
    before = (tmp_path / "results.json").read_text()
    assert [row["variant"] for row in run()] == [v.name for v in VARIANTS]  # a rerun reuses every row
    assert (tmp_path / "results.json").read_text() == before
