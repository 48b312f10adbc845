"""The house's rules, read from the code: rooms import downwards only, no import circles,
no module past the size that asks for a split, and the predictor loads no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGES = ("harness", "methods", "models")
# Bottom to top: a module may import its own room and the rooms below it, never above.
ROOMS = ("models", "methods", "harness.config", "harness.launch", "harness.measure",
         "harness.predict", "harness.report", "harness")  # harness.<command> on top
MAX_LINES = 400
NO_TORCH = ("torch", "torchvision", "transformers")


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The project's modules that `path` imports anywhere (module level or in a function)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def room(module: str) -> int:
    return max(i for i, r in enumerate(ROOMS) if module == r or module.startswith(r + "."))


def test_rooms_import_downwards_only() -> None:
    upward = [f"{a} imports {b}" for a, targets in graph().items() for b in targets
              if room(b) > room(a)]
    assert not upward, upward


def test_no_import_circles() -> None:
    edges = graph()
    # a package's __init__ importing its own modules is how a package re-exports: not a
    # circle of concepts; every other path back to the start is
    edges = {a: {b for b in bs if not (b.startswith(a + ".") and
                                        modules()[a].name == "__init__.py")}
             for a, bs in edges.items()}
    circles = []
    for start in edges:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, circles


def test_no_module_asks_to_be_split() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()
             if name.split(".")[0] in ("harness", "methods")}
    assert not {n: s for n, s in sizes.items() if s > MAX_LINES}


def _loaded_torch(code: str) -> list[str]:
    """Which of NO_TORCH a fresh interpreter has loaded after running `code`."""
    code += f"; import sys; print(sorted(m for m in {NO_TORCH!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip().splitlines()[-1])


def test_the_predictor_imports_no_torch() -> None:
    predict = sorted(n for n in modules() if n.startswith("harness.predict"))
    assert _loaded_torch(f"import {', '.join(predict)}, harness.simulate, harness.plan") == []


def test_the_configuration_imports_no_torch() -> None:
    """harness.config, its modules, and loading a simulated sweep (the simulator's path:
    every rule checked, methods and models validated from their declared parameters)."""
    config = sorted(n for n in modules() if n.startswith("harness.config"))
    assert _loaded_torch(f"import {', '.join(config)}") == []
    assert _loaded_torch("from harness import config; config.load_all(config.sweep("
                         "['experiment=paper', 'network=ib100_rdma']), simulate=True)") == []
