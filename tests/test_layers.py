"""The layers of src/sparsegen (docs/architecture.md, "## The packages"): no import circle, and no
import from a lower row to a higher one.

What counts as an import: every `import sparsegen...`, `from sparsegen... import ...` and relative
import anywhere in a module: at the top, inside functions (lazy imports) and under
`if TYPE_CHECKING:` too (none is exempt: a type named across a circle still ties the two modules
together). Imports by name at run time (`importlib.import_module`: a package's `__init__`
importing every module so that its methods register, `sparsegen.__getattr__`'s lazy API) are not
seen.

Modules are files, named by their path under src/sparsegen (`kv/cache.py`). A package's
`__init__.py` is a module of its own, and its re-exports are its imports:

- `from sparsegen.kv import make_cache` (a name `kv/__init__.py` re-exports) imports
  `kv/__init__.py`, not the module that defines the name: a module that takes a name from its own
  package's `__init__`, which imports that module in turn, is a circle (the `__init__` is half run
  when the module asks it);
- `from sparsegen.kv import ragged` (a submodule) and `import sparsegen.kv.ragged` import
  `kv/ragged.py`;
- the parent packages Python runs first (`kv/__init__.py` before `kv/cache.py`, the root's before
  everything) are not counted, or every package would be a circle with its modules.

The layers are `LAYERS`, top row first, each row a few units: a package `name/` (all its modules,
however deep), a module `name.py`, or a group of modules `name*.py`. A unit imports only from units
on lower rows; inside a unit any import goes, as long as it closes no circle. The table in
docs/architecture.md lists the same rows (`test_the_docs_table_is_the_layers`).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "sparsegen"
LAYERS = (  # top row first: docs/architecture.md draws the same table
    "__main__.py",
    "cli/",
    "__init__.py  catalog.py",
    "serve/  bench/  scale/",
    "eval/",
    "loading.py  random_model.py  prompt/",
    "gguf*.py",
    "contextual/  quant/",
    "decode/  prune/",
    "kv/  layerwise*.py  few_rows.py  fused_layers.py",
    "assemble.py  registry.py  models.py  distributed.py  sampling.py  data.py  kernels/  ioutil.py  report.py",
    "assets.py  rss.py",
    "errors.py",
)
UNIT = re.compile(r"^[\w*]+(/|\.py)$")


@dataclass(frozen=True)
class Import:
    """`source` imports `target` at `line` (modules named by their path under src/sparsegen)."""

    source: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"src/sparsegen/{self.source}:{self.line}: {self.source} -> {self.target}"


def dotted(path: str) -> str:
    """`kv/cache.py` -> `sparsegen.kv.cache`; a package's `__init__.py` is the package."""
    parts = ["sparsegen", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_in(path: str, source: str, modules: dict[str, str]) -> list[Import]:
    """The sparsegen imports of module `path` whose text is `source`; `modules` maps each module's
    dotted name to its path."""

    def known(name: str) -> str:  # the module itself, else the closest package that exists
        while name not in modules and "." in name:
            name = name.rpartition(".")[0]
        return modules[name]

    package = dotted(path) if path.endswith("__init__.py") else dotted(path).rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.split(".")[0] == "sparsegen"]
            found += [Import(path, known(name), node.lineno) for name in names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            if base.split(".")[0] != "sparsegen":
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append(Import(path, modules[sub] if sub in modules else known(base), node.lineno))
    return sorted(dict.fromkeys(found), key=lambda found: found.line)  # one per module a line


def tree_imports(package: Path = PACKAGE) -> tuple[list[str], list[Import]]:
    """Every module under `package` and every import among them."""
    paths = sorted(file.relative_to(package).as_posix() for file in package.rglob("*.py"))
    modules = {dotted(path): path for path in paths}
    return paths, [found for path in paths for found in imports_in(path, (package / path).read_text(), modules)]


def circles(modules: list[str], imports: list[Import]) -> list[str]:
    """Each import circle (a module importing itself, or a strongly connected component of more than
    one module), with the imports that close it."""
    out = {module: sorted({i.target for i in imports if i.source == module}) for module in modules}
    order, low, stack, on_stack, components = {}, {}, [], set(), []

    def visit(module: str) -> None:  # Tarjan's strongly connected components
        order[module] = low[module] = len(order)
        stack.append(module)
        on_stack.add(module)
        for target in out.get(module, ()):
            if target not in order:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], order[target])
        if low[module] == order[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            components.append(component)

    for module in modules:
        if module not in order:
            visit(module)
    problems = [f"{i}: a module imports itself" for i in imports if i.source == i.target]
    for component in components:
        if len(component) > 1:
            closing = "; ".join(str(i) for i in imports if i.source in component and i.target in component)
            problems.append(f"import circle among {', '.join(sorted(component))}: {closing}")
    return problems


def unit_of(module: str, layers: tuple[str, ...]) -> tuple[int, str] | None:
    """The row (0 at the top) and unit that hold `module`, or None."""
    for row, units in enumerate(layers):
        for unit in units.split():
            inside = module.startswith(unit) if unit.endswith("/") else "/" not in module and fnmatch(module, unit)
            if inside:
                return row, unit
    return None


def back_arrows(modules: list[str], imports: list[Import], layers: tuple[str, ...]) -> list[str]:
    """Modules no row holds, and imports of a unit on the importer's row or above it."""
    unplaced = [module for module in modules if unit_of(module, layers) is None]
    out = [f"src/sparsegen/{m}: on no row of the layers: add it to LAYERS and docs/architecture.md" for m in unplaced]
    for found in imports:
        (row, unit), (target_row, target_unit) = unit_of(found.source, layers), unit_of(found.target, layers)
        if unit != target_unit and target_row <= row:
            where = "on its own row" if target_row == row else f"on row {target_row}, above its row {row}"
            out.append(f"{found}: {unit} imports {target_unit}, {where}")
    return out


def problems(modules: list[str], imports: list[Import], layers: tuple[str, ...] = LAYERS) -> list[str]:
    """Every circle and back-arrow among `modules`, one line each (empty: the layers hold)."""
    placed = [module for module in modules if unit_of(module, layers) is not None]
    inside = [i for i in imports if i.source in placed and i.target in placed]
    return circles(modules, imports) + back_arrows(modules, inside, layers)


def test_the_tree_keeps_its_layers():
    modules, imports = tree_imports()
    assert len(modules) > 100 and len(imports) > 500  # the walk found the tree
    found = problems(modules, imports)
    assert not found, "\n".join(found)


def test_the_docs_table_is_the_layers():
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The packages", 1)[1]
    table = section.split("```", 2)[1]
    rows = [units for line in table.splitlines() if (units := [w for w in line.split() if UNIT.match(w)])]
    assert rows == [row.split() for row in LAYERS]


def test_every_form_of_import_is_read():
    modules = {dotted(path): path for path in ("__init__.py", "kv/__init__.py", "kv/cache.py", "kv/ragged.py")}
    source = """
import sparsegen
import sparsegen.kv.cache
from sparsegen.kv import ragged, make_cache
from . import ragged as again
from .cache import PolicyLayer
from .. import errors_not_a_module
import torch
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from sparsegen.kv.cache import Typed
def later():
    from sparsegen.kv.nowhere import name
"""
    targets = [(i.target, i.line) for i in imports_in("kv/cache.py", source, modules)]
    assert targets == [
        ("__init__.py", 2),
        ("kv/cache.py", 3),
        ("kv/ragged.py", 4),
        ("kv/__init__.py", 4),
        ("kv/ragged.py", 5),
        ("kv/cache.py", 6),
        ("__init__.py", 7),
        ("kv/cache.py", 11),
        ("kv/__init__.py", 13),
    ]


TOY = ("top.py", "mid/  side*.py", "low.py")
TOY_MODULES = ["top.py", "mid/__init__.py", "mid/a.py", "mid/b.py", "side.py", "side_two.py", "low.py"]
CLEAN = [
    Import("top.py", "mid/__init__.py", 1),
    Import("mid/__init__.py", "mid/a.py", 2),
    Import("mid/a.py", "mid/b.py", 3),
    Import("mid/b.py", "low.py", 4),
    Import("side.py", "side_two.py", 5),
    Import("side_two.py", "low.py", 6),
]
BAD = {  # an import added at line 9: (from, to, what the checker must say)
    "self": ("low.py", "low.py", "low.py:9: low.py -> low.py: a module imports itself"),
    "two": ("mid/b.py", "mid/a.py", "circle among mid/a.py, mid/b.py: "),
    "through __init__": ("mid/b.py", "mid/__init__.py", "circle among mid/__init__.py, mid/a.py, mid/b.py"),
    "lazy, two units": ("low.py", "mid/b.py", "low.py:9: low.py -> mid/b.py: low.py imports mid/, on row 1"),
    "same row": ("mid/a.py", "side.py", "mid/a.py:9: mid/a.py -> side.py: mid/ imports side*.py, on its own"),
    "unplaced": ("top.py", "new.py", "src/sparsegen/new.py: on no row"),
}


def test_a_clean_graph_passes():
    assert problems(TOY_MODULES, CLEAN, TOY) == []


@pytest.mark.parametrize("case", sorted(BAD))
def test_the_checker_names_each_bad_import(case: str):
    source, target, expected = BAD[case]
    modules = TOY_MODULES + ([target] if target not in TOY_MODULES else [])
    found = problems(modules, [*CLEAN, Import(source, target, 9)], TOY)
    assert any(expected in problem for problem in found), found


@pytest.mark.parametrize(
    ("source", "target", "expected"),
    [
        ("kv/cache.py", "kv/slots.py", "circle among kv/cache.py, kv/slots.py"),
        ("kv/policy.py", "kv/__init__.py", "circle among kv/__init__.py"),
        ("models.py", "kv/quantized.py", "models.py:9: models.py -> kv/quantized.py: models.py imports kv/"),
        ("kv/factory.py", "decode/engine.py", "kv/factory.py -> decode/engine.py: kv/ imports decode/, on row 8"),
    ],
)
def test_the_real_tree_fails_with_a_circle_or_back_arrow_added(source: str, target: str, expected: str):
    modules, imports = tree_imports()
    found = problems(modules, [*imports, Import(source, target, 9)])
    assert any(expected in problem for problem in found), found


MAX_FUNCTION_LINES = 60  # the house rule: from a function's `def` to its last line, decorators excluded


def long_functions(path: str, source: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each function of module `path` (methods and nested functions too) whose text in `source` runs
    over `limit` lines, one line each."""
    return [
        f"src/sparsegen/{path}:{node.lineno}: {node.name} is {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(source, path))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > limit
    ]


def test_no_function_is_over_60_lines():
    paths = sorted(file.relative_to(PACKAGE).as_posix() for file in PACKAGE.rglob("*.py"))
    found = [line for path in paths for line in long_functions(path, (PACKAGE / path).read_text())]
    assert not found, f"over {MAX_FUNCTION_LINES} lines, split into helpers:\n" + "\n".join(found)


def test_a_long_function_is_named_and_its_decorators_are_not_counted():
    fits = "@decorator\ndef fits():\n" + "    x = 1\n" * 59  # 60 lines from its `def`, 61 with the decorator
    too_long = "class A:\n    async def method(self):\n" + "        x = 1\n" * 60
    assert long_functions("toy.py", fits) == []
    assert long_functions("toy.py", too_long) == ["src/sparsegen/toy.py:2: method is 61 lines"]
