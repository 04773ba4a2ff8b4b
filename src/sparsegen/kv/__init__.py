"""KV-cache sparsity: policies that bound the cache, as a drop-in for `model.generate()`.

cache = make_cache(model, "streaming", sinks=4, recent=252)
model.generate(input_ids, past_key_values=cache, max_new_tokens=2000)
"""

from sparsegen.kv import full, h2o, streaming, streaming_h2o, window  # noqa: F401  (register policies)
from sparsegen.kv.base import POLICIES, Policy, Sizes, make_policy, register_policy, split_budget
from sparsegen.kv.cache import PolicyCache, PolicyLayer, make_cache
from sparsegen.kv.stream import StreamStep, stream

__all__ = [
    "POLICIES",
    "Policy",
    "PolicyCache",
    "PolicyLayer",
    "Sizes",
    "StreamStep",
    "make_cache",
    "make_policy",
    "register_policy",
    "split_budget",
    "stream",
]
