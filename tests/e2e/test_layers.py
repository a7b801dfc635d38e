"""The package's folders are its layers, and imports only go down.

From the bottom (`docs/architecture.md` draws it): the shared vocabulary (the modules at the package's top,
then the stop and UTF-8 policies in `policy/`), the admission arithmetic (`admission/`, the upstream's own
modules), the scheduler (`scheduler/`), the runtime (`runtime/`: its shared modules, then `quant/`, `kv/`,
`kernels/`, `architectures/`, `sampling/`, `loading/`, and the runner on top), the engine (`engine/`), then
the server, the deployments, the benchmarks and the command line. Every import in the package, lazy ones
and type-only ones included, is read from the source; one that goes up a layer, or between two folders of
one layer, fails this test with the offending line. Nor does any module import, by any path, a module that
imports it: a loop between two modules of one folder is a concept split in the wrong place.
"""

from __future__ import annotations

import ast
import graphlib
from collections.abc import Mapping
from pathlib import Path

import ferrox_batch

PACKAGE = Path(ferrox_batch.__file__).parent
#: Layer of each folder (and of the runtime's sub-packages and top modules), lowest first.
RANKS = {
    "": 0.0, "policy": 0.5,
    "admission": 1.0,
    "scheduler": 2.0,
    "runtime.families": 2.9, "runtime": 3.0, "runtime.quant": 3.05, "runtime.kv": 3.1, "runtime.kernels": 3.2, "runtime.architectures": 3.3,
    "runtime.sampling": 3.4, "runtime.loading": 3.5, "runtime.runner": 3.6,
    "engine": 4.0,
    "server": 5.0,
    "deploy": 6.0,
    "bench": 7.0,
    "cli": 8.0,
}
#: The package's facade (lazy re-exports of the public names) and its entry point stand above every layer.
EXEMPT = {"ferrox_batch", "ferrox_batch.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit(module: str) -> str:
    """The layer unit a module belongs to: its folder, a runtime sub-package, or the runner."""
    parts = module.split(".")[1:]
    if not parts or (len(parts) == 1 and not (PACKAGE / parts[0]).is_dir()):
        return ""  # a module at the package's top
    if parts[0] == "runtime" and len(parts) > 1:
        if parts[1] == "runner":
            return "runtime.runner"
        if (PACKAGE / "runtime" / parts[1]).is_dir():
            return f"runtime.{parts[1]}"
    return parts[0]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of the package in `path`, a `from package import module` as that module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ferrox_batch":
            for alias in node.names:
                nested = f"{node.module}.{alias.name}"
                is_module = (PACKAGE.parent / nested.replace(".", "/")).with_suffix(".py").exists() or \
                    (PACKAGE.parent / nested.replace(".", "/")).is_dir()
                found.append((node.lineno, nested if is_module else node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "ferrox_batch"]
    return found


def test_every_folder_has_a_layer():
    folders = {unit(module_name(p)) for p in PACKAGE.rglob("*.py") if module_name(p) not in EXEMPT}
    assert folders <= set(RANKS), f"folders with no layer: {sorted(folders - set(RANKS))}"


def test_no_import_goes_up_a_layer_or_across_one():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        if importer in EXEMPT:
            continue
        for line, imported in imports(path):
            if imported in EXEMPT:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports the package's facade")
                continue
            here, there = unit(importer), unit(imported)
            if here != there and RANKS[there] >= RANKS[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here or 'top'}) imports {imported} "
                             f"({there or 'top'})")
    assert not wrong, "imports that go up (or across) a layer:\n" + "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    # The rule is only as good as its reading of imports: a lazy, aliased import of a higher layer is found.
    source = tmp_path / "probe.py"
    source.write_text("def f():\n    from ferrox_batch.engine import handle as h\n    import ferrox_batch.cli.serve\n")
    assert [imported for _, imported in imports(source)] == ["ferrox_batch.engine.handle", "ferrox_batch.cli.serve"]
    assert RANKS[unit("ferrox_batch.engine.handle")] > RANKS[unit("ferrox_batch.scheduler.scheduler")]


def import_cycle(graph: Mapping[str, set[str]]) -> list[str]:
    """One loop of imports in `graph` (importer -> the modules it imports), as the modules round it; [] for none."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(error.args[1])
    return []


def test_no_module_imports_itself_round_a_loop():
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = module_name(path)
        graph[importer] = {imported for _, imported in imports(path) if imported != importer}
    loop = import_cycle(graph)
    assert not loop, "modules that import each other (lazy and type-only imports count): " + " -> ".join(loop)


def test_the_check_sees_a_loop_of_imports(tmp_path):
    (tmp_path / "a.py").write_text("def f():\n    from ferrox_batch.bench import copying\n")
    assert [imported for _, imported in imports(tmp_path / "a.py")] == ["ferrox_batch.bench.copying"]
    graph = {"m.a": {"m.b"}, "m.b": {"m.c"}, "m.c": {"m.a", "m.d"}, "m.d": set()}
    assert set(import_cycle(graph)) == {"m.a", "m.b", "m.c"}
    assert import_cycle({"m.a": {"m.b"}, "m.b": set()}) == []
