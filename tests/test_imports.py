"""Import directions: the packages are layers (a lower one imports nothing of a higher one, the
kernels nothing else of eagle_serve but the CPU's flags), no cycle among the modules' top-level imports, and what
runs without a model (the tokenizer-only Triton models, the clients, the processes around the
server) imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"eagle_serve": ROOT / "src" / "eagle_serve"}
# eagle_serve's packages and top-level modules, lowest first: each imports only from its own
# layer and those below it (the engine's core and its speculation use each other)
LAYERS = [("paths", "settings", "machine"), ("kernels",), ("cpu",), ("core", "spec"), ("models",),
          ("engine", "local", "client", "testing"), ("triton_backend",), ("server",),
          ("openai_api", "bench", "tools", "train", "__main__")]
TOKENIZER_ONLY = ["model_repository/preprocess/1/model.py", "model_repository/postprocess/1/model.py"]
TORCH_FREE = ["eagle_serve.settings", "eagle_serve.core.tokenization", "eagle_serve.triton_backend.io", "eagle_serve.triton_backend.client_request",
              "eagle_serve.client", "eagle_serve.paths", "eagle_serve.core.requests",
              "eagle_serve.server.serve", "eagle_serve.server.supervisor", "eagle_serve.server.health",
              "eagle_serve.server.processes", "eagle_serve.openai_api.server", "eagle_serve.server.replicas",
              "eagle_serve.machine", "eagle_serve.models.dtypes", "eagle_serve.triton_backend.features"]


def module_files() -> dict[str, Path]:
    """{dotted module name: its file} for every module of our packages."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def top_level_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Our modules that importing `path` imports: import statements outside functions."""
    def statements(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            yield node
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from statements(getattr(node, field, []))

    found = set()
    for node in statements(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: top_level_imports(path, modules) - {name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def every_import(path: Path) -> set[str]:
    """The eagle_serve modules `path` names in any import statement (in functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {f"{node.module}.{a.name}" if node.module == "eagle_serve" else node.module for a in node.names}
    return {name for name in found if name.startswith("eagle_serve.")}


def test_the_packages_are_layers_that_import_only_downward():
    rank = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
    units = {name.split(".")[1] for name in module_files() if name.count(".")}
    assert units == set(rank), "every package and top-level module has a layer"
    upward = [f"{name} imports {dep}" for name, path in module_files().items() if name.count(".")
              for dep in every_import(path) if rank[dep.split(".")[1]] > rank[name.split(".")[1]]]
    assert not upward, upward


def test_the_package_shows_its_layers():
    top = [p.stem for p in PACKAGES["eagle_serve"].glob("*.py") if p.stem != "__init__"]
    assert len(top) <= 12, top
    long = [str(p) for p in PACKAGES["eagle_serve"].rglob("*.py") if len(p.read_text().splitlines()) > 450]
    assert not long, long


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert "eagle_serve.kernels.workspace" in graph["eagle_serve.core.workspace"]  # the walk sees imports
    assert "eagle_serve.server.processes" in graph["eagle_serve.server.health"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_kernels_import_nothing_else_of_eagle_serve_but_the_cpu_flags():
    """(eagle_serve.machine: the standard library alone)"""
    kernels = {name: path for name, path in module_files().items() if name.startswith("eagle_serve.kernels")}
    upward = {m: sorted(i for i in every_import(path)
                        if not i.startswith("eagle_serve.kernels") and i != "eagle_serve.machine")
              for m, path in kernels.items()}
    assert not any(upward.values()), upward


@pytest.mark.parametrize("group", ["tokenizer-only models", "clients and server processes"])
def test_what_runs_without_a_model_imports_no_torch(group):
    if group == "tokenizer-only models":
        load = "\n".join(
            f"spec = importlib.util.spec_from_file_location('model{i}', {str(ROOT / f)!r})\n"
            f"spec.loader.exec_module(importlib.util.module_from_spec(spec))"
            for i, f in enumerate(TOKENIZER_ONLY))
        code = f"import importlib.util\n{load}\n"
    else:
        code = "".join(f"import {m}\n" for m in TORCH_FREE)
    code += "import sys\nheavy = sorted({'torch', 'transformers', 'triton'} & set(sys.modules))\n" \
            "assert not heavy, heavy\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
