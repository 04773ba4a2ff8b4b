"""Atomic writes: a finished file is either wholly there or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    _atomic(Path(path), lambda h: h.write(json.dumps(data, indent=2).encode()))


def write_text(path: Path, text: str) -> None:
    _atomic(Path(path), lambda h: h.write(text.encode()))


def save_torch(path: Path, obj: Any) -> None:
    import torch  # here, so that the modules that only write JSON or text start without torch

    _atomic(Path(path), lambda h: torch.save(obj, h))


def save_safetensors(path: Path, tensors: dict, metadata: dict[str, str] | None = None) -> None:
    """safetensors' save_file, to a temporary name beside `path` and then renamed (no copy in memory)."""
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=metadata or {"format": "pt"})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
