"""The package layout stays what docs/architecture.md says: no import circles between colocate's modules, and
errors.py at the bottom. The graph is built from the source with `ast` (nothing is imported), counting imports
inside functions too: a lazy import hides a circle from Python, not from a reader."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "colocate"


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the colocate modules it imports (a `from pkg import name` counts `pkg.name` when that is a
    module). A package's own __init__ is not an edge of its submodules: Python runs it first, by design."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]


# docs/architecture.md's layers, bottom first: a package imports only from its own layer or those below
LAYERS = [["errors"], ["config"], ["host"], ["sync"], ["models", "checkpoint", "telemetry"], ["rl"],
          ["engine", "trainer"], ["rollout"], ["job"], ["cluster", "bench", "simulate"],
          ["cli"]]


def package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "colocate"


def test_errors_is_at_the_bottom():
    assert import_graph()["colocate.errors"] == set()


def test_every_import_goes_down_the_layers():
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    upward = sorted((module, dep) for module, deps in import_graph().items() for dep in deps
                    if package_of(module) in layer and package_of(dep) in layer
                    and layer[package_of(dep)] > layer[package_of(module)])
    assert upward == []
    packages = {package_of(m) for m in import_graph()} - {"colocate"}
    assert packages == set(layer)  # every package has its layer


def test_rl_is_the_pure_algorithm():
    """rl/ (tasks, data, rewards, scoring, advantages, corrections) drives nothing: no Ray, no engine; what drives
    engines and environments is rollout/."""
    graph = import_graph()
    rl = {m for m in graph if package_of(m) == "rl"}
    assert not any(package_of(d) == "engine" for m in rl for d in graph[m])
    ray_users = sorted(m for m in rl if _imports_ray(m))
    assert ray_users == []


def _imports_ray(module: str) -> bool:
    path = ROOT / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = ROOT / module.replace(".", "/") / "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if any(n == "ray" or n.startswith("ray.") for n in names):
            return True
    return False


def test_engine_and_trainer_meet_only_in_sync():
    graph = import_graph()
    assert not any(package_of(d) == "trainer" for m, deps in graph.items() if package_of(m) == "engine" for d in deps)
    assert not any(package_of(d) == "engine" for m, deps in graph.items() if package_of(m) == "trainer" for d in deps)


def test_the_packages_docs_architecture_names():
    """Every folder of colocate/ is named in docs/architecture.md's tree, and no top-level module is left but the
    CLI and the errors."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert [f for f in folders if f"{f}/" not in text] == []
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert top == ["cli.py", "errors.py"]


def test_every_file_the_docs_and_comments_name_exists():
    """A move leaves no reader looking for a file that is gone (README, docs/, and the code's own comments)."""
    import re

    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *PACKAGE.rglob("*.py")]
    named = {m for path in texts for m in re.findall(r"\bcolocate/[a-z_/]+\.py\b", path.read_text())}
    assert len(named) > 20
    assert sorted(n for n in named if not (ROOT / n).is_file()) == []
