"""RULER's samples, made by RULER's own generators: NVIDIA's packaging of RULER on PyPI
(`nvidia-long-context-eval`, Apache-2.0), fetched once into the cache folder and run as the scripts
they are, with the model's own tokenizer calibrating each length.

Each sample is split where RULER's template puts the context and the question, so the context can
be compressed before the question is read (kvpress's query-agnostic protocol). The chat template
wraps the whole task as the user's turn where the model has one, and RULER's answer prefix opens the
assistant's turn. NLTK's trained sentence splitter needs data that is not on PyPI; the generators
get NLTK's own Punkt splitter with default parameters instead (it only decides between which
essay sentences a needle is inserted).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

import yaml

from sparsegen.assets import download_distribution, ensure_asset
from sparsegen.errors import SparsegenError
from sparsegen.ioutil import write_json

RULER = "nvidia-long-context-eval==26.3"
PACKAGE = "long_context_eval"
_EMPTY_HAYSTACK = re.compile(r"(?:Num haystack|Number of documents|Num noises|num_words|num_example_words):\s*(-?\d+)")
# Where each kind of task's question starts: its last match in the prompt (RULER's templates, which
# the niah generator rewords for a single needle; qa states its instruction before and after the documents)
QUESTION_STARTS = {
    "niah": re.compile(r"What (?:is|are all) the special magic"),
    "variable_tracking": re.compile(r"Question: Find all variables"),
    "common_words_extraction": re.compile(r"Question: What are the 10 most common words"),
    "freq_words_extraction": re.compile(r"Question: Do not provide any explanation\."),
    "qa": re.compile(r"Answer the question based on the given documents\."),
}


def ruler_root() -> Path:
    """The folder holding RULER's `long_context_eval` package (fetched from PyPI once)."""

    def build(out: Path) -> None:
        wheel = download_distribution(RULER, out)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(out, [name for name in archive.namelist() if name.startswith(f"{PACKAGE}/")])
        wheel.unlink()

    return ensure_asset("ruler-26.3", build)


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(f"ruler_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def task_table() -> dict[str, dict]:
    """RULER's 13 task settings (`synthetic.yaml`) with each task kind's template, answer prefix,
    tokens to generate and metric, as the package defines them."""
    root = ruler_root() / PACKAGE
    settings = yaml.safe_load((root / "synthetic.yaml").read_text())
    kinds = _module(root / "data" / "synthetic" / "constants.py").TASKS
    metrics = _module(root / "eval" / "synthetic" / "constants.py").TASKS
    return {
        name: {**setting, **kinds[setting["task"]], "metric": metrics[setting["task"]]["metric_fn_per_sample"]}
        for name, setting in settings.items()
    }


@dataclass
class RulerSample:
    """One RULER sample split for compression: the context's text, the question (with the chat
    template's turn change and the answer prefix), the references, and RULER's own length."""

    task: str
    length: int
    index: int
    context: str
    question: str
    references: list[str]
    generator_length: int


def check_tasks(names: list[str]) -> list[str]:
    unknown = [name for name in names if name not in task_table()]
    if unknown:
        raise SparsegenError(f"unknown RULER task {', '.join(unknown)}; choose from {', '.join(task_table())}")
    return names


def _generator_folder(haystack: Path | None, work: Path) -> Path:
    """RULER's generator scripts, or a mirror of them whose essay haystack is `haystack`'s text."""
    synthetic = ruler_root() / PACKAGE / "data" / "synthetic"
    if haystack is None:
        return synthetic
    mirror = work / f"haystack-{hashlib.sha256(haystack.read_bytes()).hexdigest()[:12]}"
    scripts = mirror / "synthetic"
    if not (scripts / "json" / "PaulGrahamEssays.json").exists():
        (scripts / "json").mkdir(parents=True, exist_ok=True)
        for source in [*synthetic.parent.glob("*.py"), *synthetic.glob("*.py")]:
            target = (scripts if source.parent == synthetic else mirror) / source.name
            if not target.exists():
                target.symlink_to(source)
        for data in ("squad.json", "hotpotqa.json"):
            if not (scripts / "json" / data).exists():
                (scripts / "json" / data).symlink_to(synthetic / "json" / data)
        write_json(scripts / "json" / "PaulGrahamEssays.json", {"text": haystack.read_text(errors="replace")})
    return scripts


def _run_generator(
    task: str, max_seq_length: int, samples: int, seed: int, tokenizer_dir: Path, folder: Path, out: Path
):
    setting = task_table()[task]
    template = setting["template"] + setting.get("answer_prefix", "")  # RULER's "base" model template
    command = [sys.executable, "-m", "sparsegen.eval.ruler_run", str(folder / f"{setting['task']}.py")]
    command += ["--save_dir", str(out), "--save_name", task, "--tokenizer_path", str(tokenizer_dir)]
    command += ["--tokenizer_type", "hf", "--max_seq_length", str(max_seq_length)]
    command += ["--tokens_to_generate", str(setting["tokens_to_generate"]), "--num_samples", str(samples)]
    command += ["--random_seed", str(seed), "--template", template]
    for key, value in setting["args"].items():
        command += [f"--{key}", str(value)]
    path = os.pathsep.join([str(ruler_root()), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}
    too_short = SparsegenError(
        f"{max_seq_length} tokens leave no room for RULER's {task} haystack after its template and "
        f"{setting['tokens_to_generate']} answer tokens: raise --lengths"
    )
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as process:  # the scripts retry forever when no haystack fits: watch what they say
        for line in process.stdout:
            found = _EMPTY_HAYSTACK.match(line.strip())
            if found and int(found.group(1)) <= 0:
                process.kill()
                raise too_short
        failure = process.stderr.read()
    if process.returncode != 0:
        last = (failure.strip().splitlines() or ["no output"])[-1]
        raise SparsegenError(f"RULER's {task} generator failed: {last}")
    lines = (out / task / "validation.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def _chat_overhead(tokenizer) -> int:
    if not getattr(tokenizer, "chat_template", None):
        return 0
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": ""}], add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(rendered, add_special_tokens=False)["input_ids"])


def _split(tokenizer, task: str, text: str) -> tuple[str, str]:
    """(context, question) of a generated input, the chat template around them where there is one:
    the question from its task's opening words, the answer prefix from its fixed first words."""
    setting = task_table()[task]
    prefix = setting.get("answer_prefix", "")
    answer_at = text.rindex(prefix.split("{")[0]) if prefix else len(text)
    user, answer_prefix = text[:answer_at], text[answer_at:]
    starts = [match.start() for match in QUESTION_STARTS[setting["task"]].finditer(user)]
    if not starts:
        raise SparsegenError(f"RULER's {task} prompt has no question where its template puts one")
    context, question = user[: starts[-1]], user[starts[-1] :]
    if not getattr(tokenizer, "chat_template", None):
        return context, question + answer_prefix
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": context + question}], add_generation_prompt=True, tokenize=False
    )
    cut = rendered.rindex(question)
    return rendered[:cut], rendered[cut:] + answer_prefix


def make_samples(
    tokenizer, task: str, length: int, samples: int, seed: int, work: Path, haystack: Path | None = None
) -> list[RulerSample]:
    """`samples` samples of `task` at `length` tokens (RULER's count: prompt plus the tokens to
    generate), kept in `work` so a second run reads them back."""
    key = {"task": task, "length": length, "samples": samples, "seed": seed, "ruler": RULER}
    key["haystack"] = None if haystack is None else hashlib.sha256(haystack.read_bytes()).hexdigest()
    key["tokenizer"] = getattr(tokenizer, "name_or_path", "")
    path = work / "samples" / f"{task}-{length}.json"
    if path.exists():
        saved = json.loads(path.read_text())
        if saved["key"] == key:
            return [RulerSample(**row) for row in saved["samples"]]
    tokenizer_dir = work / "tokenizer"
    if not (tokenizer_dir / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(tokenizer_dir)
    folder = _generator_folder(haystack, work)
    rows = _run_generator(
        task, length - _chat_overhead(tokenizer), samples, seed, tokenizer_dir, folder, work / "generated"
    )
    made = []
    for row in rows:
        context, question = _split(tokenizer, task, row["input"])
        made.append(RulerSample(task, length, row["index"], context, question, list(row["outputs"]), row["length"]))
    write_json(path, {"key": key, "samples": [asdict(sample) for sample in made]})
    return made
