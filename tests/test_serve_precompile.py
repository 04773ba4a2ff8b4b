"""The server's step compiled first in a child process: the compile here then reads its caches."""

import pytest
import torch

from sparsegen.decode import Decoder
from sparsegen.few_rows import pack_weights, restore_linears, use_gemv
from sparsegen.kv.attention import policy_attention
from sparsegen.kv.spec import KVSpec
from sparsegen.loading import load
from sparsegen.serve.compiling import warm
from sparsegen.serve.precompile import in_child


@pytest.mark.slow
def test_a_step_compiled_in_a_child_is_read_from_the_cache_here(tiny_folder, tmp_path, monkeypatch):
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: only the child fills it
    kv = KVSpec.of("h2o", budget=12)
    in_child(str(tiny_folder), kv, device=None, activation_bits=None)()
    assert any((tmp_path / "inductor").rglob("*.py"))  # the child wrote compiled code
    torch._dynamo.reset()
    model, _ = load(str(tiny_folder))
    packed = pack_weights(model)
    patched = use_gemv(model, rows_vary=True, packed=packed)
    misses = counters["inductor"]["fxgraph_cache_miss"]
    decoder = Decoder(model, kv, compile="always", rows_vary=True, packed=packed)
    try:
        with policy_attention(model), torch.inference_mode():
            warm(decoder)
        assert decoder.mode == "compiled"
    finally:
        decoder.release()
        restore_linears(patched)
    assert counters["inductor"]["fxgraph_cache_miss"] == misses  # every graph came from the child's cache
    assert counters["inductor"]["fxgraph_cache_hit"] >= 2


def test_a_child_that_cannot_load_the_model_fails_with_its_reason(tmp_path):
    with pytest.raises(RuntimeError, match="no-such-model"):
        in_child(str(tmp_path / "no-such-model"), KVSpec.of("streaming"), device=None, activation_bits=None)()
