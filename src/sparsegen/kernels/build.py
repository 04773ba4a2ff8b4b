"""C++ kernels built from the project's own source with the machine's compiler, on first use.

Each source file becomes one torch extension, built with `-O3 -march=native` and OpenMP (torch's
headers run `at::parallel_for` as inline OpenMP: serial without it; torch's own `libgomp.so.1` is
already loaded, so the loader reuses that one runtime) and cached under sparsegen's cache folder,
keyed by source, the headers it includes (`#include "name.h"` beside it), flags, CPU and torch.
Where it cannot be built (no compiler, no ninja, headers missing) `build` says why once on stderr
and returns None: each caller keeps a torch fallback.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import sys
from pathlib import Path

import torch

FLAGS = ("-O3", "-march=native", "-fopenmp")
SOURCES = Path(__file__).parent
"""The folder of every kernel source (`build_all` builds each `*.cpp` in it)."""
_INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def local_headers(source: Path) -> dict[str, bytes]:
    """The headers `source` includes by quotes from its own folder, and those they include in turn:
    {name: text}, in the order first included (what a build copies beside the source and hashes)."""
    found: dict[str, bytes] = {}
    pending = [source.read_bytes()]
    while pending:
        for name in _INCLUDE.findall(pending.pop()):
            header = source.parent / name.decode()
            if header.name not in found and header.is_file():
                found[header.name] = header.read_bytes()
                pending.append(found[header.name])
    return found


def build_folder(source: Path) -> Path:
    """The cache folder `source` is built in, named by the hash of its code, the headers it includes,
    the flags, the CPU and torch, with a copy of the source and those headers in it."""
    from sparsegen.assets import cache_dir

    code, headers = source.read_bytes(), local_headers(source)
    included = b"".join(name.encode() + b"\0" + text for name, text in headers.items())
    built_from = code + included + " ".join(FLAGS).encode() + _cpu_name().encode() + torch.__version__.encode()
    folder = cache_dir() / "kernels" / hashlib.sha256(built_from).hexdigest()[:16]
    folder.mkdir(parents=True, exist_ok=True)
    # ninja keys a build by its source's path: build a copy kept in the folder (named by the hash of
    # the code and its headers, so a copy there is this code), one path for every checkout; the
    # headers go first, so that a source found there has its headers beside it
    for name, text in [*headers.items(), (source.name, code)]:
        _write_once(folder / name, text)
    return folder


@functools.cache
def sources_hash() -> str:
    """A hash of every kernel source and header: compiled graphs are cached under it
    (`decode.engine`), since inductor's own cache key does not see what an op registered from
    C++ computes or the strides its meta function gives (a graph kept from other kernels reads
    their results in the wrong order)."""
    files = sorted([*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")])
    return hashlib.sha256(b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in files)).hexdigest()[:16]


@functools.cache
def build(source: Path, what: str):
    """The extension module built from `source` (C++ with a PYBIND11 module), or None; `what`
    names the kernels in the one-line message when they cannot be built."""
    from torch.utils import cpp_extension

    folder = build_folder(source)
    try:
        return cpp_extension.load(
            f"sparsegen_{source.stem}",
            [str(folder / source.name)],
            extra_cflags=list(FLAGS),
            extra_ldflags=["-fopenmp"],
            build_directory=str(folder),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure leaves the torch path
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        print(f"sparsegen: {what} could not be built ({reason}); using the torch path instead", file=sys.stderr)
        return None


def _write_once(path: Path, text: bytes) -> None:
    """Write `path` unless it is there: whole or not at all, whoever else builds it now."""
    if not path.exists():
        written = path.with_name(f"{path.name}.{os.getpid()}")
        written.write_bytes(text)
        os.replace(written, path)


def _cpu_name() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + platform.processor() + flags


def build_all() -> None:
    """Build every kernel source of the package now (`make install` does, so that no first use
    waits for the compiler); one already built is only loaded."""
    for source in sorted(SOURCES.glob("*.cpp")):
        print(f"sparsegen: building kernels/{source.name}", file=sys.stderr)
        build(source, f"the kernels of {source.name}")
