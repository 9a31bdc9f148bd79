"""The import graph (docs/design.md): imports run one way, scripts -> common, tasks -> fastrl/; no module of
fastrl/ imports common, tasks or a script, and nothing imports in a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOP = {p.stem for p in ROOT.glob("*.py")}  # the scripts, common, tasks (and plot_runs)


def _imports(path: Path) -> set[str]:
    """The repository's modules that `path` imports, anywhere in it (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name in TOP or (name.startswith("fastrl.") and (ROOT / f"{name.replace('.', '/')}.py").is_file()):
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {p.stem: p for p in ROOT.glob("*.py")} | {f"fastrl.{p.stem}": p for p in (ROOT / "fastrl").glob("*.py")}
    return {name: _imports(path) - {name} for name, path in modules.items()}


def test_fastrl_never_imports_common_tasks_or_a_script():
    graph = _graph()
    upward = {name: sorted(i for i in imports if not i.startswith("fastrl")) for name, imports in graph.items()
              if name.startswith("fastrl.")}
    assert not {name: up for name, up in upward.items() if up}, upward
    assert {"fastrl.checks", "fastrl.runlog", "fastrl.launch"} <= set(graph)  # the split of common.py is under test too


def test_no_import_circle():
    graph, done, path = _graph(), set(), []

    def visit(name):
        assert name not in path, " -> ".join(path[path.index(name):] + [name])
        if name in done:
            return
        path.append(name)
        for child in sorted(graph.get(name, ())):
            visit(child)
        path.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)


def test_common_and_tasks_import_no_script():
    graph = _graph()
    scripts = {"rloo_kreuse", "online_dpo_async", "pipeline_rl", "ppo_oppo"}
    assert not graph["common"] & scripts and not graph["tasks"] & scripts and "common" not in graph["tasks"]
