"""The `sparsegen` command line: `sparsegen <verb>` and `sparsegen <capability> <verb>`.

One module per command group, each thin over the library; `common` holds the app, the shared
options and the registries' catalog (read without importing torch).
"""

from __future__ import annotations

import sys

from sparsegen.cli import bench, bench_memory, bench_serving, contextual, evaluate, generate, prompt, scale, weights  # noqa: F401  (the command groups)
from sparsegen.cli.common import app, err
from sparsegen.errors import SparsegenError

__all__ = ["app", "main"]


def main() -> None:
    try:
        app()
    except SparsegenError as exc:
        err.print(f"[bold red]error:[/] {exc}", soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted: finished work is on disk; run the same command again to resume")
        sys.exit(130)


if __name__ == "__main__":
    main()
