"""Compile the server's batched step in a child process first, so the server's own compile is a
read of the on-disk caches.

A compile in the server's thread holds the GIL for most of its minutes (tracing, inductor's code
generation), and the eager steps that answer meanwhile crawl: a first answer took 136 s on a
2-core machine (docs/benchmarks.md, "Cold start"). A child process loads the same model the same
way, builds and warms the same decoder, and exits; the inductor and AOT caches it fills on disk
are what the server's `BackgroundCompile` then hits, so only Dynamo's trace runs in the server.

    python -m sparsegen.serve.precompile --model DIR --kv '{"policy": "streaming", ...}'
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sparsegen.kv.spec import KVSpec

if TYPE_CHECKING:
    import torch

TIMEOUT_S = 1800


def in_child(
    model: str, kv: KVSpec, *, device: str | None, activation_bits: int | None, dtype: torch.dtype | None = None
) -> Callable[[], None]:
    """A call that compiles `kv`'s batched step for `model` (loaded as `sparsegen.load` would,
    with `device`, `activation_bits` and `dtype`) in a child process and waits for it; a failure
    raises with the child's last words."""
    argv = [sys.executable, "-m", "sparsegen.serve.precompile", "--model", model, "--kv", json.dumps(kv.to_dict())]
    argv += ["--parent", str(os.getpid())]
    argv += ["--device", device] if device else []
    argv += ["--activation-bits", str(activation_bits)] if activation_bits else []
    argv += ["--dtype", str(dtype).removeprefix("torch.")] if dtype else []

    def run() -> None:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            )

    return run


def _exit_with(parent: int) -> None:
    """End this child as soon as the server that started it is gone (killed or stopped): its
    compile is for that server only."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str] | None = None) -> None:
    import torch

    from sparsegen.decode import Decoder
    from sparsegen.few_rows import pack_weights, use_gemv
    from sparsegen.kv.attention import policy_attention
    from sparsegen.loading import load
    from sparsegen.models import dtype_named
    from sparsegen.serve.compiling import warm

    parser = argparse.ArgumentParser(prog="python -m sparsegen.serve.precompile")
    parser.add_argument("--model", required=True)
    parser.add_argument("--kv", required=True, help="the KV spec as KVSpec.to_dict writes it (JSON)")
    parser.add_argument("--device")
    parser.add_argument("--activation-bits", type=int)
    parser.add_argument("--dtype", default=None, help="the server's weights' dtype (torch's name)")
    parser.add_argument("--parent", type=int, help="the server's pid: this child ends when it does")
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with, args=(args.parent or os.getppid(),), daemon=True).start()
    dtype = dtype_named(args.dtype) if args.dtype else None
    model, _ = load(args.model, dtype=dtype, device=args.device, activation_bits=args.activation_bits)
    packed = pack_weights(model)  # as the engine packs them, so the traced graph is the same
    use_gemv(model, rows_vary=True, packed=packed)  # the process ends with the model: nothing to give back
    decoder = Decoder(model, KVSpec.from_dict(json.loads(args.kv)), compile="always", rows_vary=True, packed=packed)
    with policy_attention(model), torch.inference_mode():
        warm(decoder)
    if decoder.mode != "compiled":
        sys.exit("the decode step did not compile")


if __name__ == "__main__":
    main()
