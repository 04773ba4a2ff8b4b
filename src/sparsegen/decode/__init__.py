"""Running the model over a KV policy's cache: prompts read into it (`read`, `stream`, one shared
prefill for many policies), then the fast decode path: a prefilled policy cache moved into
fixed-shape buffers, one compiled step per token, batches of rows of any lengths.

out = sparsegen.decode.generate(model, [ids_a, ids_b], max_new_tokens=256, kv=KVSpec.of("h2o", budget=512))
"""

from sparsegen.decode.engine import Decoder
from sparsegen.decode.generate import Generation, generate
from sparsegen.decode.reading import StreamStep, read, stream
from sparsegen.decode.shared import SharedPrefill
from sparsegen.decode.state import LayerState
from sparsegen.decode.static import StaticKV
from sparsegen.sampling import StopRule, choose, stop_tokens

__all__ = [
    "Decoder",
    "Generation",
    "LayerState",
    "SharedPrefill",
    "StaticKV",
    "StopRule",
    "StreamStep",
    "choose",
    "generate",
    "read",
    "stop_tokens",
    "stream",
]
