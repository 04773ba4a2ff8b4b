"""A model whose Linear layers are GGUF blocks (a Q4_K_M-like mix, run by the block kernels) goes
through every KV policy, the fast path, `stream` and the server as a float model does: each path
against the one no one here wrote (transformers' generate() over the policy cache), or against
the dense forward of the same model."""

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf_tiny import write_tiny
from serving import live_server
from test_serve import _ask_together

import sparsegen
from sparsegen.decode import generate, stream
from sparsegen.kv import make_cache
from sparsegen.kv.spec import KVSpec
from sparsegen.quant.gguf_blocks import GGUFLinear
from tests.kv_reference import TABLE, generate_drop_in

MIX = {
    "attn_q": Q.Q4_K,
    "attn_k": Q.Q4_K,
    "attn_v": Q.Q6_K,
    "attn_output": Q.Q4_K,
    "ffn_gate": Q.Q4_K,
    "ffn_up": Q.Q4_K,
    "ffn_down": Q.Q6_K,
    "output": Q.Q6_K,
    "token_embd": Q.Q4_K,
}


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "mix.gguf"
    write_tiny(path, "qwen2", MIX, tied=False, theta=1e6)
    model, tokenizer = sparsegen.load(str(path), device="cpu")
    assert sum(isinstance(m, GGUFLinear) for m in model.modules()) == 7 * 2 + 1 + 2  # and a joined q/k per layer
    return model, tokenizer


def _prompt(length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 250, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("policy", list(TABLE))
def test_every_policy_on_the_fast_path_equals_generate_over_the_cache(gguf_model, policy):
    model, _ = gguf_model
    budget, ids = TABLE[policy].small, _prompt(21)
    reference = generate_drop_in(model, ids, make_cache(model, KVSpec.of(policy, **budget)), 16)
    out = generate(model, ids, 16, KVSpec.of(policy, **budget), compile="never")
    assert out.tokens[0] == reference


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv"])
def test_stream_with_a_budget_over_the_text_equals_the_dense_forward(gguf_model, policy):
    model, _ = gguf_model
    ids = _prompt(23, seed=3)
    with torch.no_grad():
        dense = model(ids).logits
    logits = torch.cat(
        [step.logits for step in stream(model, ids, KVSpec.of(policy, **TABLE[policy].large), chunk=5)], 1
    )
    # the products round each row's inputs to 8 bits: a float-order difference before the rounding
    # (chunked reads against one) can move a code by one step, ~1e-2 in a logit here
    torch.testing.assert_close(logits, dense, rtol=0, atol=5e-2)
    assert (logits.argmax(-1) == dense.argmax(-1)).float().mean() >= 0.9


def test_the_server_answers_as_generate_does(gguf_model):
    model, tokenizer = gguf_model
    prompts = ["the the", "he the t", "t he he the the"]
    with live_server(gguf_model, KVSpec.of("h2o", budget=12), prefill_chunk=8) as (url, _):
        answers = _ask_together(url, prompts, [None] * len(prompts), max_tokens=8)
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        alone = generate(model, [ids], 8, KVSpec.of("h2o", budget=12), compile="never", prefill_chunk=8)
        assert answers[index] == tokenizer.decode(alone.tokens[0], skip_special_tokens=True), index
