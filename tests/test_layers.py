"""The package's imports point one way: down the layer order below, never back up, and no
module imports itself round a cycle.

Every import statement counts, also one inside a function: an import deferred to call time
still makes the importing module depend on the imported one, and deferring it is how a cycle
hides.  ``from pytrain import ggml`` is an import of ``pytrain.ggml``; the root package
(``pytrain``: ``__version__`` and the facade re-exporting the Python API) sits above everything.
The trainer is three layers: ``step`` (what one optimizer step computes), ``run`` (the run
around the steps, which drives them) and ``plan`` (``pytrain plan`` and ``pytrain profile``,
which build a run's step without training).
The Python API (``pytrain.api``: train, load, eval, export) is a layer of its own between the
trainer and the command line: the command calls it, so it cannot sit above ``cli``, and it
calls the trainer, the models and the formats below it.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytrain"
# bottom first; a module may import its own layer and the layers before it
LAYERS = ("errors", "config", "ggml", "data", "formats", "models", "step", "run", "plan", "api",
          "cli")
# modules outside a folder of their name: the version constant has no imports; the native
# extension is ggml's; the RPC server and ``python -m pytrain`` are commands
PLACED = {"pytrain._version": "errors", "pytrain._native": "ggml",
          "pytrain.rpc_server": "cli", "pytrain.__main__": "cli"}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    """Index in LAYERS; the root package is above them all."""
    if module == "pytrain":
        return len(LAYERS)
    for prefix, layer in PLACED.items():
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS.index(layer)
    return LAYERS.index(module.split(".")[1])


def imports_of(path: Path, root: Path, modules: set[str]) -> dict[str, int]:
    """``{imported pytrain module: line}`` of every import statement in ``path``, at any depth."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule pkg.sub when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t not in modules and "." in t:
                t = t.rpartition(".")[0]          # pytrain.ggml.lib -> pytrain.ggml
            if t in modules and t != name:
                out.setdefault(t, node.lineno)
    return out


def import_graph(root: Path) -> dict[str, dict[str, tuple[str, int]]]:
    """``{module: {imported module: (file, line)}}`` for every module of the package."""
    files = sorted(root.rglob("*.py"))
    modules = {module_name(f, root) for f in files}
    graph = {}
    for f in files:
        rel = str(f.relative_to(root.parent))
        graph[module_name(f, root)] = {m: (rel, line)
                                      for m, line in imports_of(f, root, modules).items()}
    return graph


def upward_imports(graph) -> list[str]:
    return [f"{file}:{line}: {mod} ({LAYERS[layer_of(mod)]}) imports {dep} "
            f"({'the root package' if dep == 'pytrain' else LAYERS[layer_of(dep)]})"
            for mod, deps in sorted(graph.items()) for dep, (file, line) in sorted(deps.items())
            if layer_of(dep) > layer_of(mod)]


def cycles(graph) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    graph = import_graph(PACKAGE)
    assert "pytrain.cli" in graph and "pytrain.formats.adapter_peft" in graph
    for mod in graph:
        layer_of(mod)          # raises for a top-level module with no layer


def test_no_import_points_up_the_layers():
    assert upward_imports(import_graph(PACKAGE)) == []


def test_no_import_cycles():
    assert cycles(import_graph(PACKAGE)) == []


@pytest.mark.parametrize("plant", ["module level", "inside a function"])
def test_a_planted_upward_import_is_found(tmp_path, plant):
    """The checks above on a copy of the package with one import of the trainer added to the
    config loader: an upward arrow, and a cycle (run/loop.py imports the config)."""
    import shutil
    copy = tmp_path / "pytrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("_native", "__pycache__"))
    target = copy / "config" / "load.py"
    line = "from pytrain.run import loop\n"
    if plant == "inside a function":
        line = "def _late():\n    from pytrain.run import loop\n    return loop\n"
    target.write_text(target.read_text(encoding="utf-8") + "\n" + line, encoding="utf-8")
    graph = import_graph(copy)
    assert any(u.startswith("pytrain/config/load.py:") and "imports pytrain.run.loop (run)"
               in u for u in upward_imports(graph))
    assert any("pytrain.config.load" in c and "pytrain.run.loop" in c for c in cycles(graph))
