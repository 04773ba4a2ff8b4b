"""Tables and plots of results."""

from __future__ import annotations

import math
import platform
import sys
from collections.abc import Sequence
from datetime import date
from pathlib import Path

from rich.table import Table


def say_estimate(first_s: float, total: int, unit: str, hint: str = "") -> None:
    """Say once, on stderr and above any progress bar, what a long loop will take in all, judged
    from its first `unit` (`first_s` seconds); `hint` names the flag that makes it shorter."""
    from tqdm.auto import tqdm

    minutes = first_s * total / 60
    span = f"{minutes:.0f} min" if minutes >= 1 else f"{first_s * total:.0f} s"
    tqdm.write(
        f"estimate: {total} {unit}s x {first_s:.1f} s = about {span}{f' ({hint})' if hint else ''}", file=sys.stderr
    )


def _fmt(value, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.3g}"
    return str(value)


def table(rows: Sequence[dict], columns: Sequence[tuple[str, str]], title: str = "") -> Table:
    """A rich table of `rows` (dicts) with (key, header) `columns`."""
    out = Table(title=title or None)
    for _, header in columns:
        out.add_column(header, justify="right" if header != columns[0][1] else "left")
    for row in rows:
        out.add_row(*(_fmt(row.get(key)) for key, _ in columns))
    return out


def markdown_table(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(row.get(k)) for k, _ in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot_lines(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    path: str | Path,
    xlabel: str,
    ylabel: str,
    title: str = "",
    vline: float | None = None,
    vline_label: str = "",
    logy: bool = False,
) -> None:
    """Write a PNG with one line per series: {label: (x, y)}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label, linewidth=1.2)
    if vline is not None:
        ax.axvline(vline, color="gray", linestyle="--", linewidth=1, label=vline_label or None)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def running_mean(values: Sequence[float], width: int) -> tuple[list[int], list[float]]:
    """Mean of consecutive non-overlapping blocks of `width`, at each block's centre."""
    xs, ys = [], []
    for start in range(0, len(values) - width + 1, width):
        block = values[start : start + width]
        xs.append(start + width // 2)
        ys.append(sum(block) / len(block))
    return xs, ys


def plot_bars(panels: dict[str, dict[str, float]], path: str | Path, title: str = "") -> None:
    """Write a PNG with one horizontal bar chart per panel: {panel (a metric): {label: value}}."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for values in panels.values() for label in values))
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels) + 5, 0.4 * len(labels) + 1.5), squeeze=False)
    for ax, (metric, values) in zip(axes[0], panels.items(), strict=True):
        ax.barh(range(len(labels)), [values.get(label, float("nan")) for label in labels])
        ax.set_yticks(range(len(labels)), labels if ax is axes[0][0] else [""] * len(labels), fontsize=8)
        ax.set_xlabel(metric)
        ax.invert_yaxis()
        ax.grid(alpha=0.3, axis="x")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    tmp = Path(path).with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def run_meta(**fields) -> dict:
    """What every benchmark result records besides its own settings: date, machine, versions."""
    import torch

    return {
        **fields,
        "date": date.today().isoformat(),
        "machine": f"{cpu_model()}, {platform.machine()}, {torch.get_num_threads()} threads",
        "torch": torch.__version__,
    }


_VECTOR_FLAGS = {
    "avx2": "AVX2",
    "avx512f": "AVX-512",
    "avx512_bf16": "AVX512-BF16",
    "avx512_vnni": "VNNI",
    "amx_tile": "AMX",
}
"""The /proc/cpuinfo flags a speed table names (what the kernels and the bf16 choice depend on)."""


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name with its family, model and vector units ("AMD EPYC (family 26 model 2;
    AVX2, AVX-512, ...)"): hosts of one machine kind differ, and so do their speed tables; a
    virtual machine's name alone ("AMD EPYC") does not tell a Zen 3 from a Zen 5."""
    fields: dict[str, str] = {}
    try:
        with open(cpuinfo) as handle:
            for line in handle:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first processor's
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" not in fields:
        return name
    flags = set(fields.get("flags", "").split())
    units = ", ".join(label for flag, label in _VECTOR_FLAGS.items() if flag in flags)
    return f"{name} (family {fields['cpu family']} model {fields.get('model', '?')}" + (f"; {units})" if units else ")")
