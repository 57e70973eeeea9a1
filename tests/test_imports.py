"""Import directions: no cycle among the modules' top-level imports, the kernels import nothing
of eagle_serve, and what runs without a model (the tokenizer-only Triton models, the clients,
the processes around the server) imports no torch."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"eagle_serve": ROOT / "src" / "eagle_serve", "kernels": ROOT / "kernels"}
TOKENIZER_ONLY = ["model_repository/preprocess/1/model.py", "model_repository/postprocess/1/model.py"]
TORCH_FREE = ["eagle_serve.settings", "eagle_serve.tokenization", "eagle_serve.triton_utils",
              "eagle_serve.client", "eagle_serve.paths", "eagle_serve.requests",
              "eagle_serve.serve", "eagle_serve.supervisor", "eagle_serve.health",
              "eagle_serve.processes", "eagle_serve.openai_api.server", "eagle_serve.replicas"]


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


def test_no_module_imports_itself_back_through_others():
    graph = import_graph()
    assert "kernels.workspace" in graph["eagle_serve.workspace"]  # the walk sees imports
    assert "eagle_serve.processes" in graph["eagle_serve.health"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_kernels_import_nothing_of_eagle_serve():
    graph = import_graph()
    upward = {m: sorted(i for i in deps if i.startswith("eagle_serve"))
              for m, deps in graph.items() if m.startswith("kernels")}
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
