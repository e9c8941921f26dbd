"""The import structure of ``mlx_edge0``: every module imports alone, the
import graph has no cycle but the known ones, and click stays in the CLI.

The graph is read from the source with ``ast``: every ``import`` statement
anywhere in a module (top level, inside functions, under ``TYPE_CHECKING``),
relative or absolute, that names a module of the package.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx_edge0

ROOT = Path(__file__).resolve().parents[1]
# package name -> source directory (pyproject.toml maps the last two)
PACKAGE_DIRS = {
    "mlx_edge0": ROOT / "mlx_edge0",
    "mlx_edge0.model_patches": ROOT / "model_patches",
    "mlx_edge0.conversions": ROOT / "conversions",
}
# Cycles allowed in the graph, each listed from its smallest module name: none
# (``TYPE_CHECKING`` imports count too). Any cycle fails the test.
KNOWN_CYCLES: set[tuple[str, ...]] = set()
# The modules that may import click: the command line.
CLI_MODULES = {
    "mlx_edge0.cli",
    "mlx_edge0.flags",
    "mlx_edge0.serve",
    "mlx_edge0.bench.commands",
    "mlx_edge0.bench.command_options",
    "mlx_edge0.train.commands",
    "mlx_edge0.train.phase_commands",
}
IMPORT_TIMEOUT_S = 120  # per module: an import that hangs fails, named


def package_modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (source file, is a package) for every module of mlx_edge0."""
    found = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in sorted(directory.rglob("*.py")):
            parts = list(path.relative_to(directory).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts = parts[:-1]
            found[".".join([package, *parts])] = (path, is_package)
    return found


def imported_names(path: Path, package: str) -> set[str]:
    """Every module name (and ``module.attribute``) an import statement in ``path`` names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)  # from . import store
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    modules = package_modules()
    graph = {}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        graph[name] = {n for n in imported_names(path, package) if n in modules and n != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every elementary cycle, each once: starting at its smallest module name."""
    found = set()

    def walk(start: str, path: list[str]) -> None:
        for nxt in graph[path[-1]]:
            if nxt == start:
                found.add(tuple(path))
            elif nxt > start and nxt not in path:
                walk(start, [*path, nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


def test_the_graph_sees_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
        "def f():\n    from . import c\n    import pkg.d\n    from ..pkg.sub import e\n"
    )
    assert imported_names(pkg / "a.py", "pkg") >= {"pkg.b", "pkg.c", "pkg.d", "pkg.sub", "pkg.sub.e"}
    assert cycles({"a": {"b"}, "b": {"c", "a"}, "c": {"a"}}) == {("a", "b"), ("a", "b", "c")}


def test_the_graph_covers_every_package():
    modules = package_modules()
    assert {
        "mlx_edge0.cli",
        "mlx_edge0.bench.commands",
        "mlx_edge0.model_patches.bailing",
        "mlx_edge0.conversions.converter",
    } <= set(modules)
    assert Path(mlx_edge0.__file__).resolve().parent == PACKAGE_DIRS["mlx_edge0"]


def test_no_import_cycles_but_the_known_ones():
    found = cycles(import_graph())
    new = found - KNOWN_CYCLES
    assert not new, "import cycles: " + "; ".join(" -> ".join((*c, c[0])) for c in sorted(new))
    assert found == KNOWN_CYCLES, f"cycles gone (remove them from KNOWN_CYCLES): {sorted(KNOWN_CYCLES - found)}"


def test_click_only_in_the_command_line():
    modules = package_modules()
    users = {
        name
        for name, (path, is_package) in modules.items()
        if any(
            n == "click" or n.startswith("click.")
            for n in imported_names(path, name if is_package else name.rpartition(".")[0])
        )
    }
    assert users <= CLI_MODULES, f"click imported outside the CLI modules: {sorted(users - CLI_MODULES)}"


def test_every_module_imports_alone():
    """Each module in a fresh interpreter of its own (an import that only
    works after another module was imported first fails here)."""
    names = sorted(package_modules())
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}

    def import_alone(name: str) -> tuple[str, int, str]:
        r = subprocess.run(
            [sys.executable, "-c", f"import {name}"], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S, env=env
        )
        return name, r.returncode, (r.stderr.strip().splitlines() or [""])[-1]

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        results = list(pool.map(import_alone, names))
    failed = [f"{name}: {err}" for name, rc, err in results if rc != 0]
    assert not failed, "\n".join(failed)
