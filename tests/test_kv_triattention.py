"""TriAttention's calibration (`eval.calibrate_heads.query_centres`) against the model's own query
projections, and the calibrated policy against the one scoring with the prompt's own queries.
(Its scores against brute force, and the fast path's and server's equality, are rows of
tests/kv_reference.py's table.)"""

import pytest
import torch

from sparsegen.errors import SparsegenError
from sparsegen.eval.calibrate_heads import query_centres, save_centres
from sparsegen.kv import make_cache, policy_attention
from sparsegen.kv.spec import KVSpec
from tests.conftest import build_tiny


def test_query_centres_equal_the_query_projections_before_rope():
    """Brute force: each layer's q_proj output (queries before RoPE, no inversion), in float64."""
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 50), generator=torch.Generator().manual_seed(1))
    projected = []
    hooks = [
        layer.self_attn.q_proj.register_forward_hook(lambda _m, _i, out: projected.append(out.double()))
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    mean, magnitude = query_centres(model, ids[0].tolist(), sinks=4)
    d = model.config.head_dim
    for layer, out in enumerate(projected):
        queries = out[0, 4:].view(46, -1, d).transpose(0, 1)  # [heads, n, d], the first 4 left out
        torch.testing.assert_close(mean[layer].double(), queries.mean(1), rtol=1e-4, atol=1e-5)
        bands = torch.hypot(queries[..., : d // 2], queries[..., d // 2 :]).mean(1)
        torch.testing.assert_close(magnitude[layer].double(), bands, rtol=1e-4, atol=1e-5)


def test_centres_of_the_prompt_itself_keep_what_the_prompts_own_queries_keep(tmp_path):
    """Compressing a prompt read in one call: centres calibrated on that very prompt (sinks left out,
    as the policy leaves them out) keep the same tokens as the policy's own statistics of it."""
    model = build_tiny("llama")
    ids = torch.randint(3, 96, (1, 60), generator=torch.Generator().manual_seed(2))
    save_centres(*query_centres(model, ids[0].tolist(), sinks=4), tmp_path / "centres.json", "tiny", "ids")
    kept = []
    for centres in (None, str(tmp_path / "centres.json")):
        cache = make_cache(model, KVSpec.of("triattention", sinks=4, heavy=12, recent=4, centres=centres))
        with policy_attention(model), torch.no_grad():
            model(ids, cache=cache, use_cache=True)
        kept.append([layer.kept_positions() for layer in cache.policy_layers()])
    assert kept[0] == kept[1]
    assert all(len(head) == 20 for layer in kept[0] for row in layer for head in row)  # it evicted


def test_triattention_refuses_centres_of_another_model_and_a_missing_file(tmp_path):
    save_centres(torch.zeros(5, 3, 8), torch.zeros(5, 3, 4), tmp_path / "centres.json", "other", "text")
    model = build_tiny("llama")
    cache = make_cache(model, KVSpec.of("triattention", budget=16, centres=str(tmp_path / "centres.json")))
    with pytest.raises(SparsegenError, match="calibrated for another model"), policy_attention(model):
        model(torch.randint(3, 96, (1, 40)), cache=cache, use_cache=True)
    with pytest.raises(SparsegenError, match="calibrate-centres"):
        KVSpec.of("triattention", budget=16, centres=str(tmp_path / "none.json"))


def test_calibrate_centres_command_writes_centres_the_policy_reads(monkeypatch, capsys, tiny_folder, tmp_path):
    from tests.test_cli import run_cli

    path = tmp_path / "centres.json"
    args = ["eval", "calibrate-centres", "--model", tiny_folder, "--tokens", "96", "--out", path]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "3 layers x 4 query heads" in out
    assert KVSpec.of("triattention", budget=16, centres=str(path)).policy.centres == str(path)
    code, _, err = run_cli(monkeypatch, capsys, "eval", "calibrate-centres", "--model", tiny_folder, "--tokens", "8")
    assert code != 0 and "--tokens" in err and "Traceback" not in err
