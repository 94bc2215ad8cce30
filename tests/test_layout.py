"""The package layout holds: no file imports a file that imports it back (a package's
`__init__` counts: importing a module runs its packages' first), the replay never imports the
report, argparse stays in the command modules, run.json is read in one place, and no function
is above what a newcomer reads in one go (radon's cyclomatic complexity, which counts more than
ruff's). That the read-only commands load without torch is tests/experiments/test_torch_free.py;
what `flexbench compare` loads, tests/experiments/test_compare_imports.py."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flexdemo", "netsim", "experiments")
MAX_COMPLEXITY = 15


def _module_files() -> dict[str, Path]:
    files = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path
    return files


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """Every module of ours `path` imports, at the top, under TYPE_CHECKING or in a function."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule's file when there is one.
            subs = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
            found |= subs or {base}
    # Importing a.b.c runs a/__init__.py and a/b/__init__.py first, and their imports with
    # them; the importer's own packages are running already.
    own = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 2)}
    found |= {parent for m in found for k in range(1, m.count(".") + 1)
              if (parent := ".".join(m.split(".")[:k])) not in own}
    return {m for m in found if m in modules and m != name}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_file_imports_a_file_that_imports_it_back():
    modules = _module_files()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_flexdemo_and_netsim_never_import_each_other_nor_experiments():
    """The package boundaries of docs/architecture.md: the two meet only in experiments."""
    modules = _module_files()
    allowed = {"flexdemo": {"flexdemo"}, "netsim": {"netsim"}}
    crossing = [
        f"{name} imports {dep}"
        for name, path in modules.items()
        if (own := name.split(".")[0]) in allowed
        for dep in sorted(_imports(path, name, modules))
        if dep.split(".")[0] not in allowed[own]
    ]
    assert not crossing, "; ".join(crossing)


def test_the_replay_never_imports_the_report():
    """The statistics both use are experiments.scoring's; the report replays, never the reverse."""
    modules = _module_files()
    found = [f"{name} imports {dep}" for name, path in modules.items()
             if name.startswith("experiments.replay")
             for dep in sorted(_imports(path, name, modules))
             if dep.startswith("experiments.report")]
    assert not found, "; ".join(found)


def _command_modules() -> set[str]:
    """The modules `flexbench` runs a command from, and those that declare shared flags."""
    from experiments.cli import COMMANDS

    flags = {"experiments.cli", "experiments.config", "experiments.values",
             "experiments.replay.flags", "experiments.aliases"}
    return {module for module, _ in COMMANDS.values()} | flags


def test_argparse_is_imported_by_command_modules_alone():
    """A setting reaches library code as a typed value, never as a parsed command line."""
    allowed = _command_modules()
    found = []
    for name, path in _module_files().items():
        tree = ast.parse(path.read_text())
        uses = any(isinstance(node, ast.Import) and any(a.name == "argparse" for a in node.names)
                   or isinstance(node, ast.ImportFrom) and node.module == "argparse"
                   for node in ast.walk(tree))
        script = "__main__" in path.read_text()  # a script's own command line (python -m)
        if uses and name not in allowed and not script:
            found.append(name)
    assert not found, f"argparse imported outside the command modules: {', '.join(found)}"


def _reads(node: ast.AST) -> bool:
    """Whether a call reads a file: json.load(s), read_text, read_bytes or open."""
    func = node.func if isinstance(node, ast.Call) else None
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name in ("load", "loads", "read_text", "read_bytes", "open")


def test_run_json_is_read_in_one_place():
    """Every reader of a run folder goes through experiments.run_record.RunRecord.load (its
    writer, experiments.run.folder, and the content hash of experiments.io aside)."""
    found = []
    for name, path in _module_files().items():
        if name in ("experiments.run_record", "experiments.run.folder", "experiments.io"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if _reads(node) and any(isinstance(sub, ast.Constant) and sub.value == "run.json"
                                    for sub in ast.walk(node)):
                found.append(f"{name}:{node.lineno}")
    assert not found, f"run.json read outside RunRecord.load: {', '.join(found)}"


def test_the_check_sees_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_function_above_complexity_15_by_radon():
    from radon.complexity import cc_visit

    too_complex = [
        f"{path.relative_to(ROOT)}:{block.lineno} {block.fullname} ({block.complexity})"
        for path in _module_files().values()
        for block in cc_visit(path.read_text())
        if block.complexity > MAX_COMPLEXITY
    ]
    assert not too_complex, "; ".join(too_complex)
