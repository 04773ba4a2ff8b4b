"""After every public entry point that runs a model under a KV policy, the model is as it was given:
its attention implementation, no hooks, no patched forward, and a forward equal to a fresh model's."""

import httpx
import pytest
import torch
from conftest import build_tiny, tiny_tokenizer
from serving import live_server

from sparsegen.decode import generate, stream
from sparsegen.decode.chat import StreamingChat
from sparsegen.decode.shared import SharedPrefill
from sparsegen.eval.calibrate_heads import calibrate_heads
from sparsegen.eval.harness import SparsegenLM
from sparsegen.eval.needle import needle_job
from sparsegen.eval.stream_ppl import PolicyRun, stream_compare
from sparsegen.kv import make_cache, make_policy
from sparsegen.kv.spec import KVSpec
from sparsegen.prompt.prompted import PromptedModel
from sparsegen.prompt.soft import SoftPrompt

TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w4 {% else %}w5 {% endif %}{{ m['content'] }} </s> "
    "{% endfor %}{% if add_generation_prompt %}w5 {% endif %}"
)
IDS = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(0))
PROBE = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(1))


def _tokenizer():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def _generate(model, tmp_path):
    generate(model, IDS, 6, KVSpec.of("h2o", heavy=6, recent=6), compile="never")


def _generate_compiled(model, tmp_path):
    generate(model, IDS, 3, KVSpec.of("streaming", sinks=2, recent=10), compile="always")


def _stream_left_early(model, tmp_path):
    steps = stream(model, IDS, KVSpec.of("tova", budget=12), chunk=8)
    next(steps)
    steps.close()  # a caller that stops reading: the scope still ends


def _chat(model, tmp_path):
    chat = StreamingChat(model, _tokenizer(), KVSpec.of("streaming", sinks=2, recent=30), max_new_tokens=4)
    "".join(chat.ask("w10 w11 w12"))


def _shared_prefill(model, tmp_path):
    shared = SharedPrefill(model, IDS[0].tolist())
    cache = shared.cache_for(make_policy("snapkv", budget=10))
    generate(model, [[5, 6]], 3, cache.policy, compile="never", held=[cache])


def _needle(model, tmp_path):
    filler = " ".join(f"w{3 + i % 90}" for i in range(400))
    needle_job(model, _tokenizer(), filler, ["streaming"], [24], [0.5], 60, 1, tmp_path / "needle.json")


def _stream_perplexity(model, tmp_path):
    runs = [PolicyRun("full", "full"), PolicyRun("h2o", KVSpec.of("h2o", heavy=4, recent=4))]
    stream_compare(model, IDS[0], runs, chunk=8, reference="full", progress=False)


def _lm_eval(model, tmp_path):
    from lm_eval.api.instance import Instance

    lm = SparsegenLM(loaded=(model, _tokenizer()), policy="streaming", budget=12, sinks=2)
    lm.loglikelihood([Instance("loglikelihood", {}, ("w5 w6 w7 w8 w9 w10 w11 w12 w13 w14", " w15"), 0)])
    lm.generate_until([Instance("generate_until", {}, ("w5 w6 w7", {"until": ["w9"], "max_gen_toks": 3}), 0)])


def _soft_prompt(model, tmp_path):
    prompted = PromptedModel(model, SoftPrompt(torch.randn(3, 64) * 0.02), KVSpec.of("streaming", sinks=2, recent=20))
    generate(model, IDS, 3, prompted.kv, compile="never", held=[prompted.cache()])


def _server(model, tmp_path):
    with live_server((model, _tokenizer()), KVSpec.of("h2o", heavy=8, recent=8)) as (url, _):
        body = {"model": "tiny", "prompt": "w5 w6 w7 w8", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200


def _make_cache(model, tmp_path):
    make_cache(model, KVSpec.of("pyramidkv", budget=10))


def _calibrate_heads(model, tmp_path):
    calibrate_heads(model, _tokenizer(), samples=1, length=96)


ENTRY_POINTS = [
    _generate,
    pytest.param(_generate_compiled, marks=pytest.mark.slow),  # a compile: the whole suite, not the fast tier
    _stream_left_early,
    _chat,
    _shared_prefill,
    _needle,
    _stream_perplexity,
    _lm_eval,
    _soft_prompt,
    _server,
    _make_cache,
    _calibrate_heads,
]


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=lambda entry: getattr(entry, "__name__", "").strip("_"))
def test_the_model_is_left_as_it_was_given(entry, tmp_path):
    model, fresh = build_tiny("llama"), build_tiny("llama")
    entry(model, tmp_path)
    assert model.config._attn_implementation == fresh.config._attn_implementation == "sdpa"
    assert not any(module._forward_pre_hooks or "forward" in module.__dict__ for module in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(PROBE).logits, fresh(PROBE).logits, rtol=0, atol=0)
