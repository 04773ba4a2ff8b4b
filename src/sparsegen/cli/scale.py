"""`sparsegen sweep`: a grid of configurations x evaluations, run as Ray tasks."""

from __future__ import annotations

from pathlib import Path

import typer

from sparsegen.cli.common import DeviceOpt, app, err, out
from sparsegen.errors import SparsegenError


@app.command("sweep")
def sweep_command(
    grid_file: Path = typer.Argument(..., help="YAML grid: model, calibration, prune/quantize/kv axes, evaluations."),
    out_dir: Path = typer.Option(Path("results/sweep"), "--out", help="Cells, table and plot go here."),
    address: str | None = typer.Option(None, "--address", help="A Ray cluster to join (default: a local Ray)."),
    device: str | None = DeviceOpt,
) -> None:
    """Every cell of GRID_FILE as a Ray task; finished cells are kept, so a rerun resumes."""
    import yaml

    from sparsegen.ioutil import write_text
    from sparsegen.report import markdown_table, plot_bars
    from sparsegen.scale.sweep import sweep

    if not grid_file.is_file():
        raise SparsegenError(f"no grid file at {grid_file}; write one as the docstring of sparsegen.scale.sweep shows")
    try:
        grid = yaml.safe_load(grid_file.read_text())
    except yaml.YAMLError as exc:
        raise SparsegenError(f"{grid_file} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(grid, dict) or "model" not in grid:
        raise SparsegenError(f"{grid_file} must be a mapping with at least `model:` and `evaluations:`")
    rows = sweep(grid, out_dir, address, progress=lambda message: err.print(f"[dim]{message}[/]"), device=device)
    settings = ("prune", "quantize", "kv", "evaluation", "cell")
    metrics = sorted({key for row in rows for key in row if key not in settings})
    columns = [(key, key) for key in settings[:-1]] + [(m, m) for m in metrics]
    write_text(out_dir / "sweep.md", markdown_table(rows, columns))
    panels = {m: {row["cell"]: row[m] for row in rows if m in row} for m in metrics}
    plot_bars(panels, out_dir / "sweep.png", f"sweep of {grid['model']}")
    out.print(markdown_table(rows, columns) + f"\n-> {out_dir / 'sweep.md'}, {out_dir / 'sweep.png'}")
