"""The bench's load generators (`sparsegen bench serve`, `sparsegen bench soak`) against a live server."""

import time

import httpx
import pytest
from serving import live_server
from test_serve import LARGE, _loaded

from sparsegen.kv.spec import KVSpec


@pytest.mark.parametrize(("spec", "watch"), [("h2o:0.5", True), ("h2o:0.5@4", True), ("h2o:0.5", False)])
def test_bench_load_sees_every_answer_equal_to_its_single_request_run(spec, watch, monkeypatch):
    """`sparsegen bench serve`'s load generator: concurrent streamed clients, answers checked; its
    health polls go through one client (a new one per poll cost the measured server a quarter core),
    and none run where the peaks are not wanted (`bench peers`)."""
    import sparsegen.bench.serve as bench_serve
    from sparsegen.bench.serve import ServeConfig, run_load, single_request_answers

    one_off_gets, polls = [], []
    monkeypatch.setattr(bench_serve.httpx, "get", lambda *a, **k: one_off_gets.append(a))
    client_get = httpx.Client.get

    def counted_get(client, url, *args, **kwargs):
        polls.extend([url] if str(url).endswith("/health") else [])
        return client_get(client, url, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "get", counted_get)

    loaded = _loaded()
    prompts = [[5 + i for i in range(length)] for length in (3, 17, 40)]
    config = ServeConfig.parse(spec)
    assert config.kv_bits == (4 if spec.endswith("@4") else None)
    with live_server(loaded, config.kv, prefill_chunk=8) as (url, _):
        point = run_load(url, "tiny", prompts, clients=3, requests=2, max_tokens=6, watch=watch)
    references = single_request_answers(*loaded, config, prompts, 6, chunk=8)
    assert len(point["answers"]) == 6
    assert all(text == references[which] for which, text in point["answers"])
    assert point["tokens_per_s"] > 0 and point["refused"] == 0
    assert one_off_gets == []
    if watch:
        assert point["most_active"] >= 1 and polls
    else:
        assert point["most_active"] is None and not polls


def test_soak_requests_get_their_answers_and_leave_no_row():
    from sparsegen.bench.soak import SOAK_KINDS, soak_request

    loaded = _loaded()
    with live_server(loaded, KVSpec.of("streaming", **LARGE)) as (url, _), httpx.Client() as client:
        outcomes = [soak_request(client, url, "tiny", i, [5, 6, 7, 8], 8) for i in range(len(SOAK_KINDS) * 2)]
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").json()["active"] and time.monotonic() < deadline:
            time.sleep(0.1)
        health = httpx.get(f"{url}/health").json()
    by_kind = {o["kind"]: o for o in outcomes}
    assert by_kind["bad field"]["status"] == 400 and by_kind["too long"]["status"] == 400
    assert by_kind["bad seed"]["status"] == 400 and by_kind["not utf-8"]["status"] == 400
    assert by_kind["not utf-8"]["error"] and by_kind["abandoned prompt"]["status"] == 200
    assert by_kind["chat"]["status"] == 200 and by_kind["cancel"]["status"] == 200
    assert all(o["tokens"] >= 1 for o in outcomes if o["kind"] == "greedy")
    assert health["active"] == 0 and health["queued"] == 0
