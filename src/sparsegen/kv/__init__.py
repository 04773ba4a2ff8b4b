"""KV-cache sparsity: policies that bound the cache, as a drop-in for `model.generate()`.

with policy_attention(model):  # sparsegen's attention for the block, the model's own after it
    cache = make_cache(model, KVSpec.of("streaming", sinks=4, recent=252))
    model.generate(input_ids, cache=cache, max_new_tokens=2000)
"""

import importlib
import pkgutil

from sparsegen.kv.attention import policy_attention
from sparsegen.kv.cache import PolicyLayer
from sparsegen.kv.factory import make_cache
from sparsegen.kv.policy import POLICIES, Policy, Sizes, Step, make_policy, register_policy, resolve_budget
from sparsegen.kv.policy_cache import PolicyCache
from sparsegen.kv.spec import KVSpec

# Every module of this package is imported, so a policy registers itself by existing as a file.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "POLICIES",
    "KVSpec",
    "Policy",
    "PolicyCache",
    "PolicyLayer",
    "Sizes",
    "Step",
    "make_cache",
    "make_policy",
    "policy_attention",
    "register_policy",
    "resolve_budget",
]
