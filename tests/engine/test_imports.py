"""The packages import in one direction, server -> engine -> models, with no cycle between modules.

Read from the source with `ast`, so every import counts: at module level, inside a
function, or under `if TYPE_CHECKING:`. loadtest drives servers from outside and is
imported by none of them.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engine", "models", "loadtest")
# What each package may import of the others.
ALLOWED = {
    "server": {"engine", "models"},
    "engine": {"models"},
    "models": set(),
    "loadtest": {"engine", "models"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name an import in the file can load: `from a.b import c` gives a.b and a.b.c."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    files = {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}
    return {name: {m for m in imported_names(path, name) if m in files and m != name} for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph[name]):
            if cycle := visit(dep):
                return cycle
        path.pop()
        done.add(name)
        return None

    for name in sorted(graph):
        if cycle := visit(name):
            return cycle
    return None


def test_the_graph_is_read():
    graph = import_graph()
    assert "engine.block_manager" in graph["engine.scheduler"]
    assert "engine.request" in graph["server.serving_common"]
    assert "models.loader" in graph["server.__main__"]  # an import inside a function counts


def test_no_import_cycle_between_modules():
    assert find_cycle(import_graph()) is None


def test_a_cycle_would_be_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_packages_import_downwards_only():
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        if (src := name.split(".")[0]) != (dst := dep.split(".")[0]) and dst not in ALLOWED[src]
    )
    assert wrong == []


def test_the_scheduler_and_the_step_data_import_no_torch():
    # Their docstrings promise it: they run and are tested without the model's world.
    code = "import sys, engine.scheduler, engine.step; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
