"""The server's admission: KV needs, arrival order, conversations dropped for room, releases."""

import pytest

from sparsegen.errors import SparsegenError
from sparsegen.kv.spec import KVSpec
from sparsegen.sampling import StopRule
from sparsegen.serve.admission import Admission, QueueFull
from sparsegen.serve.conversations import Conversation, ConversationStore
from sparsegen.serve.jobs import GenerationRequest, Job
from sparsegen.serve.metrics import Metrics


def _job(admission, prompt: int, max_tokens: int, policy: str = "streaming", kv_bits: int | None = None, **budget):
    request = GenerationRequest(range(prompt), max_tokens, KVSpec.of(policy, kv_bits=kv_bits, **budget))
    return Job(request, print, StopRule(max_tokens), kv_need=admission.need(request))


def test_jobs_are_admitted_in_order_while_their_kv_fits_and_released_jobs_free_it():
    store = ConversationStore()
    admission = Admission(
        max_kv_bytes=100, row_bytes=lambda tokens, bits: tokens, max_queue=3, conversations=store, metrics=Metrics()
    )
    bounded, whole = _job(admission, 500, 20, sinks=4, recent=35), _job(admission, 30, 20, "full")  # 40 tokens + 1, 50
    later = _job(admission, 10, 5, "full")
    for job in (bounded, whole, later):
        admission.check(job, arriving=0)
        admission.waiting.append(job)
    assert (bounded.kv_need, whole.kv_need, later.kv_need) == (40, 50, 15)
    assert admission.admit_next() is bounded and admission.admit_next() is whole
    assert admission.admit_next() is None and admission.held_bytes() == 90  # 15 more do not fit
    admission.release(bounded)
    assert admission.admit_next() is later and admission.held_bytes() == 65
    with pytest.raises(SparsegenError, match="more than the server's --max-kv-mb"):
        admission.check(_job(admission, 200, 1, "full"), arriving=0)


def test_held_conversations_make_room_least_recently_kept_first_and_the_queue_is_bounded():
    store = ConversationStore()
    admission = Admission(
        max_kv_bytes=100, row_bytes=lambda tokens, bits: tokens, max_queue=1, conversations=store, metrics=Metrics()
    )
    old, new = Conversation(cache=None, text="a", nbytes=40), Conversation(cache=None, text="b", nbytes=40)
    store.keep(old)
    store.keep(new)
    job = _job(admission, 30, 20, "full")
    admission.check(job, arriving=0)
    admission.waiting.append(job)
    assert admission.admit_next() is job and len(store) == 1 and store.continued_by("bc") is new
    assert admission.held_bytes() == 90
    with pytest.raises(QueueFull):
        admission.check(_job(admission, 5, 5, "full"), arriving=1)
    cancelled = _job(admission, 5, 5, "full")
    admission.check(cancelled, arriving=0)
    admission.waiting.append(cancelled)
    cancelled.cancelled.set()
    assert admission.admit_next() is None and not admission.waiting


def test_rows_holding_kv_in_fewer_bits_are_counted_at_their_bytes():
    """The same KV memory admits as many more rows as each one's bytes are fewer (rounded rows
    count their ring of full-precision newest tokens too)."""
    per_token, ring = {None: 12, 8: 5, 4: 3}, {None: 0, 8: 24, 4: 24}  # e.g. fp32, int8, int4 with scales
    counts = {}
    for bits in per_token:
        row_bytes = lambda tokens, bits: tokens * per_token[bits] + ring[bits]  # noqa: E731
        admission = Admission(1000, row_bytes, max_queue=64, conversations=ConversationStore(), metrics=Metrics())
        for _ in range(30):
            job = _job(admission, 20, 5, "full", kv_bits=bits)
            admission.check(job, arriving=0)
            admission.waiting.append(job)
        while admission.admit_next() is not None:
            pass
        counts[bits] = len(admission.admitted)
    assert counts == {None: 3, 8: 6, 4: 10}  # rows of 25 tokens: 300, 149 and 99 bytes in 1000
