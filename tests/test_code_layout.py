"""The project's module graph, read statically from the source (nothing is imported):

- no import cycle among the project's own modules: the packages afd_operator,
  afd_shared_experts and afd_devcluster, and the modules in tests/ and tests/plugin/ (imported
  by their file name: pyproject's `pythonpath` and pytest's rootdir conftests put those folders
  on sys.path);
- no file outside tests/ edits sys.path: scripts, benchmarks and the packages import what is
  installed (the dev venv holds all three packages);
- no Python file of the project grows past MAX_MODULE_LINES: a longer one holds two things
  that the next change would rather find apart.

An import counts when it runs at import time: at module level, also inside `if`, `try`,
`with` and class bodies, and under `if TYPE_CHECKING:` (a cycle there still ties the two
modules together). Imports inside functions are lazy and do not count.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional

PACKAGE_ROOTS = ("operator", "plugin", "devcluster")
HELPER_FOLDERS = ("tests", "tests/plugin", "tests/realnode")


def project_modules(repo_root: Path) -> dict[str, Path]:
    """Module name -> file, for the three packages and the test folders."""
    modules: dict[str, Path] = {}
    for root in PACKAGE_ROOTS:
        for path in sorted((repo_root / root).glob("afd_*/**/*.py")):
            parts = list(path.relative_to(repo_root / root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    for folder in HELPER_FOLDERS:
        for path in sorted((repo_root / folder).glob("*.py")):
            if path.name == "conftest.py":  # every conftest is module `conftest`; nothing imports them
                continue
            assert path.stem not in modules, f"{path} and {modules[path.stem]} are both module {path.stem}"
            modules[path.stem] = path
    return modules


def import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported (function bodies excluded)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        for field in ("body", "orelse", "finalbody"):
            yield from import_time_statements(getattr(node, field, []))
        for handler in getattr(node, "handlers", []):
            yield from import_time_statements(handler.body)


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that module `name` imports at import time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in import_time_statements(ast.parse(path.read_text(), str(path)).body):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from package import submodule` imports the submodule; any other name is an attribute.
            found.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in node.names)
    return {module for module in found if module in modules and module != name}


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One import cycle (its modules in import order, the first repeated at the end), or None."""
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> Optional[list[str]]:
        if module in visiting:
            return visiting[visiting.index(module):] + [module]
        if module in done:
            return None
        visiting.append(module)
        for target in sorted(graph[module]):
            cycle = visit(target)
            if cycle:
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        cycle = visit(module)
        if cycle:
            return cycle
    return None


def edits_sys_path(tree: ast.Module) -> list[int]:
    """Lines that change sys.path: a call of one of its methods, an assignment to it or an item
    of it, `from sys import path`, or site.addsitedir."""
    def is_sys_path(node: ast.AST) -> bool:
        if isinstance(node, ast.Subscript):
            node = node.value
        return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys")

    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            receiver = node.func.value
            if is_sys_path(receiver) or (isinstance(receiver, ast.Name) and receiver.id == "site"
                                         and node.func.attr == "addsitedir"):
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(target) for target in targets):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys" and any(a.name == "path" for a in node.names):
            lines.append(node.lineno)
    return lines


def test_project_modules_import_no_cycle(repo_root: Path) -> None:
    modules = project_modules(repo_root)
    assert {"afd_operator", "afd_shared_experts", "afd_devcluster", "plugin_harness", "k8s_helpers"} <= set(modules)
    graph = {name: imported_modules(name, path, modules) for name, path in modules.items()}
    assert graph["afd_devcluster.realnode.node"] >= {"afd_devcluster.realnode.images"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_find_cycle_names_the_modules_of_a_cycle_and_nothing_else() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_lazy_imports_do_not_count_and_type_checking_ones_do(tmp_path: Path) -> None:
    package = tmp_path / "afd_example"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (package / "b.py").write_text("def later():\n    from afd_example import a\n")
    (package / "c.py").write_text("class C:\n    from afd_example.a import TYPE_CHECKING\n")
    modules = {"afd_example": package / "__init__.py",
               **{f"afd_example.{m}": package / f"{m}.py" for m in ("a", "b", "c")}}
    assert {name: imported_modules(name, path, modules) for name, path in modules.items()} == {
        "afd_example": set(), "afd_example.a": {"afd_example.b"}, "afd_example.b": set(),
        "afd_example.c": {"afd_example.a"}}


def python_files(repo_root: Path) -> list[str]:
    """The project's Python files (tracked or new, not ignored), relative to the root."""
    listed = subprocess.run(["git", "-C", str(repo_root), "ls-files", "-z", "-co", "--exclude-standard", "*.py"],
                            capture_output=True, check=True, text=True).stdout.split("\0")
    return [rel for rel in listed if rel and (repo_root / rel).is_file()]


def test_no_sys_path_edits_outside_tests(repo_root: Path) -> None:
    sources = [repo_root / rel for rel in python_files(repo_root) if not rel.startswith("tests/")]
    assert any(path.name == "e2e_cpu.py" for path in sources)
    edits = {str(path.relative_to(repo_root)): lines for path in sources
             if (lines := edits_sys_path(ast.parse(path.read_text(), str(path))))}
    assert edits == {}


MAX_MODULE_LINES = 500
# Longer on purpose, with why (their limit is where they stand now: they may shrink, not grow); none today.
LONGER_MODULES: dict[str, int] = {}


def test_modules_stay_short(repo_root: Path) -> None:
    lengths = {rel: len((repo_root / rel).read_text().splitlines()) for rel in python_files(repo_root)}
    assert set(LONGER_MODULES) <= set(lengths)
    too_long = {rel: lines for rel, lines in lengths.items() if lines > LONGER_MODULES.get(rel, MAX_MODULE_LINES)}
    assert too_long == {}


def test_every_kind_of_sys_path_edit_is_seen() -> None:
    sources = ["import sys\nsys.path.insert(0, 'x')", "import sys\nsys.path[:0] = ['x']", "import sys\nsys.path += ['x']",
               "from sys import path", "import site\nsite.addsitedir('x')", "import sys\nsys.path = []"]
    assert [bool(edits_sys_path(ast.parse(source))) for source in sources] == [True] * len(sources)
    assert edits_sys_path(ast.parse("import os, sys\nprint(sys.path, os.path.join('a', 'b'))")) == []


def test_the_operator_and_afdctl_import_without_torch(repo_root: Path) -> None:
    """The operator image installs no torch: what the operator and afdctl import of the plugin
    (its afd-block config, the checkpoint's MoE description) must not need it."""
    blocker = ("import importlib.abc, sys\n"
               "class Block(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'safetensors', 'vllm'):\n"
               "            raise ImportError('the operator must not import ' + name)\n"
               "sys.meta_path.insert(0, Block())\n"
               "import afd_operator.main, afd_operator.cli, afd_operator.checkpoint\n")
    result = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=repo_root,
                            env={**os.environ, "PYTHONPATH": f"{repo_root / 'operator'}:{repo_root / 'plugin'}"})
    assert result.returncode == 0, result.stderr[-2000:]
