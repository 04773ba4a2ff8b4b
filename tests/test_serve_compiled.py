"""The server's compiled batched step: built while the server answers eagerly; rows join and leave
without compiling it again."""

import threading

from serving import live_server
from test_serve import _ask_together, _loaded

from sparsegen.kv.spec import KVSpec


def test_the_compiled_batched_step_never_recompiles_as_rows_join_and_leave(monkeypatch):
    from torch._dynamo.utils import counters

    from sparsegen.serve import batching
    from sparsegen.serve.compiling import BackgroundCompile

    gate = threading.Event()  # the compile starts when the test says (in one process it can be cached: instant)

    class Gated(BackgroundCompile):
        def _run(self) -> None:
            gate.wait(600)
            super()._run()

    monkeypatch.setattr(batching, "BackgroundCompile", Gated)

    from sparsegen.decode import generate

    loaded = _loaded()
    model, tokenizer = loaded
    prompts = [" ".join(f"w{5 + (i * 13 + j) % 90}" for j in range(n)) for i, n in enumerate((5, 33, 12, 48, 21, 9))]
    with live_server(loaded, KVSpec.of("h2o", budget=12), prefill_chunk=8, compile=True) as (url, app):
        early = _ask_together(url, prompts[:2], [None, None], max_tokens=10)  # before the step is compiled
        assert app.state.engine.stats()["step"] == "compiling"
        gate.set()
        assert app.state.engine.compiled.wait(600)
        assert app.state.engine.stats()["step"] == "compiled"
        warmed = counters["stats"]["unique_graphs"]
        assert [lane.decoder.mode for lane in app.state.engine.lanes.values()] == ["compiled"]
        alone = _ask_together(url, prompts[:1], [None], max_tokens=10)  # one row
        together = _ask_together(url, prompts, [None] * len(prompts), max_tokens=10)  # rows join and leave
        other = _ask_together(url, prompts[:1], [{"kv_policy": "streaming", "kv_budget": 16}], max_tokens=4)
        assert counters["stats"]["unique_graphs"] == warmed and other[0]  # another lane steps eagerly
        modes = sorted(lane.decoder.mode for lane in app.state.engine.lanes.values())
        assert modes == ["compiled", "eager"]
        assert app.state.engine.stats()["active"] == 0
    assert not [m for m in model.modules() if "forward" in m.__dict__]  # close() gave the model back
    assert alone[0] == together[0] and early == {0: together[0], 1: together[1]}
    for index, prompt in enumerate(prompts):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        eager = generate(model, [ids], 10, KVSpec.of("h2o", budget=12), compile="never", prefill_chunk=8)
        assert together[index] == tokenizer.decode(eager.tokens[0], skip_special_tokens=True), index
