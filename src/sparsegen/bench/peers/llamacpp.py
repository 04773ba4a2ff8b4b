"""llama.cpp run in its own interpreter (where llama-cpp-python is installed): each call starts one
of the workers beside this file by path, feeds it token ids through a JSON file and reads one JSON
line back. `sparsegen bench decode --llama-cpp PYTHON` and `sparsegen bench peers` use them.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from sparsegen.errors import SparsegenError


def llama_cpp_row(
    python: str,
    model_name: str,
    prompt: list[int],
    new_tokens: int,
    threads: int,
    gguf: Path | None = None,
    flash: bool = False,
) -> dict:
    """llama.cpp decoding a GGUF (`gguf`, else the model's own file) after `prompt`, in the
    interpreter `python`, with its flash attention on or off."""
    from gguf import GGUFReader

    from sparsegen.loading import gguf_file

    path = gguf or gguf_file(model_name)
    worker = Path(__file__).with_name("llamacpp_worker.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as ids:
        json.dump(prompt, ids)
        ids.flush()
        done = subprocess.run(
            [python, str(worker), str(path), ids.name, str(new_tokens), str(threads), "1" if flash else "0"],
            capture_output=True,
            text=True,
        )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SparsegenError(f"llama.cpp failed under {python} ({last}); is llama-cpp-python installed there?")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tensors = GGUFReader(str(path)).tensors
    kinds = sorted({t.tensor_type.name for t in tensors})
    weight_mb = sum(int(t.n_bytes) for t in tensors) / 1e6
    return {**result, "weight_mb": weight_mb, "gguf": f"{path.name} ({', '.join(kinds)})"}


def llama_cpp_choices(python: str, gguf: str, ids: list[int], threads: int, flash: bool = False) -> dict:
    """llama.cpp's argmax and NLLs at the same positions, under the interpreter `python`, with its
    flash attention off or on."""
    worker = Path(__file__).with_name("llamacpp_logits_worker.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handle:
        json.dump(ids, handle)
        handle.flush()
        command = [python, str(worker), gguf, handle.name, str(threads), "1" if flash else "0"]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SparsegenError(f"llama.cpp failed under {python} ({last}); is llama-cpp-python installed there?")
    return json.loads(done.stdout.strip().splitlines()[-1])
