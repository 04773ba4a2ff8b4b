"""The engine's Prometheus metrics, in a registry of its own so several servers can share a process."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector


class Metrics:
    """Counters the engine and the routes update; gauges the engine sets when they are read."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        registry = {"registry": self.registry}
        self.requests = Counter("sparsegen_requests", "Requests answered", ["endpoint", "status"], **registry)
        self.prompt_tokens = Counter("sparsegen_prompt_tokens", "Prompt tokens received", **registry)
        self.completion_tokens = Counter("sparsegen_completion_tokens", "Tokens generated", **registry)
        self.reuses = Counter("sparsegen_conversation_reuses", "Requests that continued a held cache", **registry)
        self.admitted = Counter("sparsegen_admitted", "Requests admitted, per KV policy", ["policy"], **registry)
        self.refused = Counter("sparsegen_refused_queue_full", "Requests refused with 429", **registry)
        self.ttft = Histogram("sparsegen_time_to_first_token_seconds", "Time to first token", **registry)
        self.kv_bytes = Gauge("sparsegen_kv_bytes_held", "Bytes of keys and values admitted or held", **registry)
        self.conversations = Gauge("sparsegen_conversations_held", "Conversations held", **registry)
        self.active = Gauge("sparsegen_active_generations", "Rows prefilling or decoding", **registry)
        self.queued = Gauge("sparsegen_requests_queued", "Requests waiting for KV memory", **registry)
