"""What the command line shows of the method registries, without importing torch at start-up.

The registries are the truth: each family's methods register themselves when their package is
imported, which pulls in torch and transformers (seconds). The CLI needs only their names and
one-line help to build its options, so `catalog()` reads them once, keeps the result in the cache
folder and reuses it until a source file of sparsegen changes (or its version does).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sparsegen import __version__

SOURCE = Path(__file__).parent


def read_registries() -> dict:
    """The names and one-line help of every registered method, from the registries themselves."""
    from sparsegen.contextual import SELECTORS
    from sparsegen.contextual.selector import faster_selectors
    from sparsegen.kv import POLICIES
    from sparsegen.prune import PRUNERS
    from sparsegen.quant import QUANTIZERS

    return {
        "policies": sorted(POLICIES),
        "streamable_policies": [name for name, cls in POLICIES.items() if not cls.prefill_only],
        "policy_help": POLICIES.help(),
        "selectors": {name: SELECTORS.summary(name) for name in sorted(SELECTORS)},
        "faster_selectors": faster_selectors(),
        "pruners": sorted(PRUNERS),
        "quantizers": sorted(QUANTIZERS),
    }


def _fingerprint() -> str:
    stats = sorted((str(p.relative_to(SOURCE)), p.stat().st_mtime_ns, p.stat().st_size) for p in SOURCE.rglob("*.py"))
    return f"{__version__}:{hashlib.sha256(json.dumps(stats).encode()).hexdigest()}"


def catalog_path() -> Path:
    """Where this installation's catalog is kept (one per source folder: checkouts do not share)."""
    from sparsegen.assets import cache_dir

    return cache_dir() / f"cli_catalog-{hashlib.sha256(str(SOURCE).encode()).hexdigest()[:12]}.json"


def catalog() -> dict:
    """`read_registries()`, kept in the cache folder while no source file changes."""
    from sparsegen.ioutil import write_json

    path = catalog_path()
    key = _fingerprint()
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") == key:
            return stored["registries"]
    except (OSError, ValueError):
        pass
    registries = read_registries()
    write_json(path, {"key": key, "registries": registries})
    return registries
