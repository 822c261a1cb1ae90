"""Import cycles among the modules of one kvdepot package, lazy imports (inside
functions) included: a module importing another only in a function still depends on it.

    python scripts/import_cycles.py [kvdepot.bench]

Prints each cycle and exits 1 if there is one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"


def imports_of(path: Path, package: str, modules: set[str]) -> set[str]:
    """The modules of `package` that the module at `path` imports anywhere."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == package:  # from kvdepot.bench import transfer
                found.update(f"{package}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle, once each, by depth-first search from each module."""
    found: dict[frozenset[str], list[str]] = {}

    def walk(path: list[str]) -> None:
        for following in sorted(graph[path[-1]]):
            if following in path:
                cycle = path[path.index(following):]
                found.setdefault(frozenset(cycle), [*cycle, following])
            else:
                walk([*path, following])

    for module in sorted(graph):
        walk([module])
    return list(found.values())


def main() -> int:
    package = sys.argv[1] if len(sys.argv) > 1 else "kvdepot.bench"
    folder = SRC.joinpath(*package.split("."))
    files = {f"{package}.{path.stem}": path for path in folder.glob("*.py")
             if path.stem != "__init__"}
    modules = set(files)
    graph = {name: imports_of(path, package, modules) - {name} for name, path in files.items()}
    found = cycles(graph)
    for cycle in found:
        print(" -> ".join(cycle))
    print(f"{len(graph)} modules of {package}, {len(found)} import cycle(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
