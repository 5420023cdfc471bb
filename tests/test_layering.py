"""Layering: storage (``sparsenn.formats``) never imports the compiler or the layers, the
compiler never imports the layers, no module of the compiler imports itself through others
(no import cycle), every third-party module the library imports is a declared dependency,
and only the command's modules import the ``models`` extra. Checked on the source
(``ast``), so lazy imports inside functions count too."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest
import torch

import sparsenn
from sparsenn.formats import arithmetic

PACKAGE = Path(sparsenn.__file__).parent
ROOT = PACKAGE.parent
# The repository's reference models, loaded by the CLI with an error naming the folder
# when sparsenn runs outside a checkout; not part of the distribution.
REPOSITORY_PACKAGES = {"models"}
# The `sparsenn` command: the only modules that may import the `models` extra.
COMMAND_MODULES = {"sparsenn.cli", "sparsenn.lightning_cli", "sparsenn.main_job", "sparsenn.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(path: Path) -> str:
    """The package a relative import in ``path`` starts from."""
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def imports_of(source: str, package: str, annotations: bool = True) -> set[str]:
    """Absolute names of every module ``source`` (a module of ``package``) imports,
    relative imports resolved, imports inside functions included; without
    ``annotations``, those under ``if TYPE_CHECKING:`` (never run) left out."""
    parts = package.split(".")
    names = set()
    tree = ast.parse(source)
    skipped = set()
    if not annotations:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                skipped.update(id(inner) for child in node.body for inner in ast.walk(child))
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(part for part in (base, node.module or "") if part)
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def imported_modules(path: Path, annotations: bool = True) -> set[str]:
    return imports_of(path.read_text(), package_of(path), annotations)


def import_graph(folder: str) -> dict[str, set[str]]:
    """Module -> the modules of ``folder`` it imports when it runs (lazy imports included,
    those for type annotations only not). ``from pkg import name`` reads ``pkg.name``
    when that is a module, else ``pkg`` (its ``__init__``); the parent packages a
    module's import runs first are not edges."""
    modules = {module_name(path): path for path in modules_under(folder)}
    graph = {}
    for name, path in modules.items():
        graph[name] = {found for found in imported_modules(path, annotations=False)
                       if found in modules and found != name}
        # ``from pkg import submodule`` names both; the submodule is the one read
        graph[name] -= {package for package in graph[name]
                        if any(other.startswith(package + ".") for other in graph[name])
                        and modules[package].name == "__init__.py"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of more than one
    module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            following = next(edges, None)
            if following is not None:
                if following not in index:
                    index[following] = low[following] = len(index)
                    stack.append(following)
                    on_stack.add(following)
                    work.append((following, iter(sorted(graph[following]))))
                elif following in on_stack:
                    low[node] = min(low[node], index[following])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def modules_under(folder: str) -> list[Path]:
    return sorted((PACKAGE / folder).rglob("*.py"))


def offending(paths: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {}
    for path in paths:
        names = imported_modules(path)
        bad = sorted(n for n in names if n in forbidden or n.startswith(tuple(f + "." for f in forbidden)))
        if bad:
            found[str(path.relative_to(ROOT))] = bad
    return found


def test_formats_imports_neither_compiler_nor_layers() -> None:
    paths = modules_under("formats")
    assert len(paths) >= 5
    # ``sparsenn`` itself re-exports the compiler: importing it from storage is an import of the compiler.
    forbidden = ("sparsenn.compiler", "sparsenn.layers", "sparsenn.convert", "sparsenn.cli")
    assert offending(paths, forbidden) == {}
    top_level = {str(p): n for p in paths for n in imported_modules(p) if n == "sparsenn"}
    assert top_level == {}


def test_compiler_never_imports_layers() -> None:
    paths = modules_under("compiler")
    assert len(paths) >= 10
    assert offending(paths, ("sparsenn.layers", "sparsenn.convert", "sparsenn.cli")) == {}


def test_the_compiler_has_no_import_cycle() -> None:
    """Every module of ``sparsenn.compiler`` can be read knowing only the modules below it
    (each cycle is listed by its modules' names)."""
    graph = import_graph("compiler")
    assert len(graph) >= 50 and "sparsenn.compiler.api" in graph
    # autograd's backward under a torch.func transform runs gradients' Function, whose
    # rules are autograd's: the one cycle left (its two modules are to become one layer)
    assert cycles(graph) == [["sparsenn.compiler.autograd", "sparsenn.compiler.gradients"]]


def test_the_cycle_check_finds_a_cycle_through_a_lazy_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_checker_resolves_relative_and_lazy_imports() -> None:
    source = "def f():\n    from ..compiler import operators\n    import sparsenn.layers.linear\n"
    names = imports_of(source, "sparsenn.formats")
    assert {"sparsenn.compiler", "sparsenn.compiler.operators", "sparsenn.layers.linear"} <= names
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .tensor import SparseTensor\n"
    assert "sparsenn.formats.tensor" in imports_of(typed, "sparsenn.formats")
    assert "sparsenn.formats.tensor" not in imports_of(typed, "sparsenn.formats", annotations=False)
    assert package_of(PACKAGE / "formats" / "tensor.py") == "sparsenn.formats"
    assert package_of(PACKAGE / "formats" / "__init__.py") == "sparsenn.formats"


# Storage alone (no compiler installed its arithmetic): each operator's error, one a line.
STORAGE_ALONE = textwrap.dedent(
    """
    import sys
    import torch
    import sparsenn.formats

    assert not [name for name in sys.modules if name.startswith(("sparsenn.compiler", "sparsenn.layers"))]
    a = sparsenn.formats.from_dense(torch.eye(2), "csr")
    for operation in (lambda: a + a, lambda: a @ torch.ones(2)):
        try:
            operation()
        except RuntimeError as error:
            print(error)
    """
)


def test_operators_without_the_compiler_raise_a_clear_error(tmp_path: Path) -> None:
    """In a process that loaded ``sparsenn.formats`` alone (an install holding the storage
    package only: ``sparsenn`` without its ``__init__``, so nothing imports the compiler)."""
    (tmp_path / "sparsenn").mkdir()
    (tmp_path / "sparsenn" / "formats").symlink_to(PACKAGE / "formats")
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", STORAGE_ALONE], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    errors = done.stdout.splitlines()
    assert len(errors) == 2
    assert all("arithmetic (+, -, *, @) is computed by the sparse einsum compiler" in e for e in errors)
    assert all("import sparsenn.compiler first" in e for e in errors)


def test_install_rejects_other_objects() -> None:
    with pytest.raises(TypeError, match="expected an Arithmetic, got dict"):
        arithmetic.install_arithmetic({})


def test_operators_are_installed_on_import() -> None:
    a = sparsenn.from_dense(torch.eye(2, dtype=torch.float64), "csr")
    assert torch.equal((a + a - a).to_dense(), torch.eye(2, dtype=torch.float64))
    assert torch.equal(a @ torch.ones(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64))


def normalised(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def declared_dependencies(extra: str | None = None) -> set[str]:
    """The distributions pyproject requires, or those of one ``extra``."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    names = set()
    for requirement in requirements:
        name = requirement
        for stop in "<>=!~[; ":
            name = name.split(stop)[0]
        names.add(normalised(name))
    return names


def third_party_imports(paths: list[Path]) -> list[str]:
    top_level = {n.split(".")[0] for p in paths for n in imported_modules(p)}
    return sorted(top_level - set(sys.stdlib_module_names) - {"sparsenn", "__future__"} - REPOSITORY_PACKAGES)


def undeclared(modules: list[str], declared: set[str]) -> dict[str, list[str]]:
    distributions = packages_distributions()
    return {module: distributions.get(module, [module]) for module in modules
            if not any(normalised(d) in declared for d in distributions.get(module, [module]))}


def test_every_third_party_import_is_a_declared_dependency() -> None:
    """The library needs only pyproject's dependencies; ``import lightning`` in the command
    needs ``lightning`` in the ``models`` extra."""
    paths = sorted(PACKAGE.rglob("*.py"))
    command = [p for p in paths if module_name(p) in COMMAND_MODULES]
    library = [p for p in paths if module_name(p) not in COMMAND_MODULES]
    assert len(command) == len(COMMAND_MODULES)
    library_imports, command_imports = third_party_imports(library), third_party_imports(command)
    assert "torch" in library_imports and "lightning" in command_imports and "lightning" not in library_imports
    assert undeclared(library_imports, declared_dependencies()) == {}
    assert undeclared(command_imports, declared_dependencies() | declared_dependencies("models")) == {}
