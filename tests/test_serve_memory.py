"""The memory bound a server states at start (`serve.memory`), against counts made here by hand."""

import httpx
import torch
from serving import live_server
from test_serve import _loaded

from sparsegen.serve.memory import tensor_bytes, workspace_bytes


def test_tied_and_viewed_tensors_count_once():
    shared = torch.zeros(10, 4)
    other = torch.zeros(3, dtype=torch.float16)
    assert tensor_bytes([shared, shared[2:], shared.T, other]) == 10 * 4 * 4 + 3 * 2


def test_the_workspace_is_a_chunk_through_one_layer_and_the_logits():
    model, _ = _loaded()
    config = model.config
    chunk, rows = 16, 5
    activations = 4 * config.hidden_size + 3 * config.intermediate_size
    scores = config.num_attention_heads * (config.max_position_embeddings + chunk)
    expected = 4 * (chunk * (activations + scores) + (chunk + 2 * rows) * config.vocab_size)
    assert workspace_bytes(config, chunk, rows) == expected


def test_health_states_the_bound_with_the_weights_and_the_kv_cap():
    loaded = _loaded()
    model = loaded[0]
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    with live_server(loaded, "streaming", {"budget": 16}, max_kv_bytes=3 << 20) as (url, app):
        bound = httpx.get(f"{url}/health").json()["memory_bound"]
        described = app.state.engine.memory.describe()
    assert bound["weights"] == weights and bound["kv"] == 3 << 20
    assert bound["total"] == bound["at_start"] + bound["kv"] + bound["workspace"]
    assert bound["at_start"] > bound["weights"] and described.startswith("memory bound ")
