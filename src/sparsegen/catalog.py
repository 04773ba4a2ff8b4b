"""What the command line shows of the method registries, read from their source without importing torch.

The registries are the truth: each family's methods register themselves when their package is
imported, which pulls in torch and transformers (seconds). The CLI needs only their names and
one-line help to build its options, so `catalog()` reads them from the source files with `ast`
(milliseconds, with no build step and no cache to go stale): a method is a class in its family's
package decorated with the family's `register_*`. A test keeps the catalog equal to the registries.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sparsegen.registry import help_entry, summary_line

SOURCE = Path(__file__).parent
FAMILIES = {  # the catalog's key: (the family's package, the decorator that registers a method)
    "policies": ("kv", "register_policy"),
    "selectors": ("contextual", "register_selector"),
    "pruners": ("prune", "register_pruner"),
    "quantizers": ("quant", "register_quantizer"),
}


@cache
def _source(path: Path) -> str:
    return path.read_text()


@cache
def _parsed(path: Path) -> ast.Module:
    return ast.parse(_source(path), str(path))


def _name_of(expression: ast.expr) -> str | None:
    """The name a decorator or annotation is written with: `x`, `module.x` and `x(...)` all give "x"."""
    if isinstance(expression, ast.Call):
        return _name_of(expression.func)
    if isinstance(expression, ast.Subscript):
        return _name_of(expression.value)
    if isinstance(expression, ast.Attribute):
        return expression.attr
    return expression.id if isinstance(expression, ast.Name) else None


def _module_path(module: str) -> Path | None:
    """The source file of a sparsegen module (a package's `__init__.py`); None for other modules."""
    if module.partition(".")[0] != SOURCE.name:
        return None
    path = SOURCE.parent.joinpath(*module.split("."))
    return next((file for file in (path.with_suffix(".py"), path / "__init__.py") if file.is_file()), None)


def _find_class(path: Path, name: str) -> tuple[ast.ClassDef, Path] | None:
    """The class `name` as the module at `path` sees it: defined there or imported from sparsegen."""
    for node in _parsed(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node, path
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if (alias.asname or alias.name) == name and (source := _module_path(node.module)):
                    return _find_class(source, alias.name)
    return None


def _lineage(node: ast.ClassDef, path: Path) -> list[ast.ClassDef]:
    """The class, then its sparsegen bases depth first (their resolution order: the methods inherit singly)."""
    lineage = [node]
    for base in node.bases:
        found = _find_class(path, base.id) if isinstance(base, ast.Name) else None
        if found:
            lineage += [cls for cls in _lineage(*found) if cls not in lineage]
    return lineage


def _assigned_name(statement: ast.stmt) -> str | None:
    """The name a class-body statement `x = ...` or `x: T = ...` assigns a value to."""
    if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
        target = statement.targets[0]
    elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
        target = statement.target
    else:
        return None
    return target.id if isinstance(target, ast.Name) else None


def _is_init_field(statement: ast.stmt) -> bool:
    """A dataclass field its `__init__` takes: annotated, not a ClassVar, not `field(init=False)`."""
    if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
        return False
    if _name_of(statement.annotation) == "ClassVar":
        return False
    value = statement.value
    if isinstance(value, ast.Call) and _name_of(value) == "field":
        return not any(k.arg == "init" and ast.literal_eval(k.value) is False for k in value.keywords)
    return True


@dataclass(frozen=True)
class DeclaredMethod:
    """A registered method as its source declares it: its class first, then its sparsegen bases."""

    lineage: tuple[ast.ClassDef, ...]

    def attribute(self, name: str) -> Any:
        """A class attribute's literal value, inherited as Python looks it up (None where unset)."""
        for cls in self.lineage:
            for statement in cls.body:
                if _assigned_name(statement) == name:
                    return ast.literal_eval(statement.value)
        return None

    @property
    def summary(self) -> str:
        return summary_line(ast.get_docstring(self.lineage[0], clean=False))

    @property
    def settings(self) -> list[str]:
        """Its init fields in `dataclasses.fields` order: the bases' first, each named once."""
        names: list[str] = []
        for cls in reversed(self.lineage):
            if any(_name_of(decorator) == "dataclass" for decorator in cls.decorator_list):
                names += [s.target.id for s in cls.body if _is_init_field(s) and s.target.id not in names]
        return names


def declared_methods(package: str, decorator: str) -> dict[str, DeclaredMethod]:
    """The methods a family's package registers, by name: its modules' classes marked `@decorator`."""
    methods = {}
    for path in sorted((SOURCE / package).glob("*.py")):
        if f"@{decorator}" not in _source(path):  # most modules register nothing: not parsed
            continue
        for node in _parsed(path).body:
            if isinstance(node, ast.ClassDef) and decorator in map(_name_of, node.decorator_list):
                method = DeclaredMethod(tuple(_lineage(node, path)))
                methods[method.attribute("name")] = method
    return methods


def catalog() -> dict:
    """The names and one-line help of every registered method, as the registries would give them."""
    methods = {family: declared_methods(*where) for family, where in FAMILIES.items()}
    policies, selectors = methods["policies"], methods["selectors"]
    return {
        "policies": sorted(policies),
        "streamable_policies": sorted(
            name for name, method in policies.items() if not method.attribute("prefill_only")
        ),
        "policy_help": "; ".join(
            help_entry(name, policies[name].settings, policies[name].summary) for name in sorted(policies)
        ),
        "selectors": {name: selectors[name].summary for name in sorted(selectors)},
        "faster_selectors": sorted(name for name, method in selectors.items() if not method.attribute("needs_hidden")),
        "pruners": sorted(methods["pruners"]),
        "quantizers": sorted(methods["quantizers"]),
    }
