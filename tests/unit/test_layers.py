"""The package's layers point one way (STYLE rule 13, docs/design-notes.md "Layers"), read from the
source with ``ast``: every import of a megamarl module, at module level or inside a function, goes to
the importing module's own layer or below; no two files import each other, directly or round a
circle; and no function imports a megamarl module (a local import is a sign of code in the wrong
room). Imports under ``if TYPE_CHECKING:`` count for the layers, not for circles (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megamarl"

# Lowest first. A module may import its own layer and those below it.
LAYERS = {
    "config": 0, "config_loader": 0, "config_sections": 0, "registry": 0,
    "parallel": 1, "models": 1,
    "rl": 2, "rollout": 2, "orchestration": 2,
    "driver": 3, "runtime": 3, "planning": 3,
    "trainer": 4, "run": 4, "vllm_plugins": 4,
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def _resolve(name: str) -> str | None:
    """The megamarl module an imported dotted name lives in (``a.b.func`` -> ``a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES and name != "megamarl" else None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(n) for n in ast.walk(node)}
    return ids


def _imports(module: str) -> list[tuple[str, int, bool, bool]]:
    """(imported megamarl module, line, inside a function, under TYPE_CHECKING) for each import."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    typing_only = _type_checking_nodes(tree)
    in_function = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for n in ast.walk(f)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        targets = {t for t in map(_resolve, (n for n in names if n.startswith("megamarl"))) if t and t != module}
        for target in sorted(targets):
            found.append((target, node.lineno, id(node) in in_function, id(node) in typing_only))
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m != "megamarl" and _layer(m) is None)
    assert not missing, f"add these to LAYERS (and docs/design-notes.md): {missing}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "megamarl"))
def test_imports_point_down(module):
    upward = [f"{module}:{line} imports {target} (layer {_layer(target)} > {_layer(module)})"
              for target, line, _, _ in IMPORTS[module] if _layer(target) > _layer(module)]
    assert not upward, "\n".join(upward)


def test_no_function_imports_a_megamarl_module():
    local = [f"{module}:{line} imports {target} inside a function"
             for module, imports in IMPORTS.items() for target, line, in_function, _ in imports if in_function]
    assert not local, "\n".join(local)


def test_no_import_circles_between_files():
    graph = {m: sorted({t for t, _, _, typing_only in imports if not typing_only}) for m, imports in IMPORTS.items()}
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "\n".join(circles)


# Module-level functions that several modules define on purpose: a CLI's entry point and the model
# families' protocol function (models/registry.py dispatches to each family's).
PROTOCOL_FUNCTIONS = ("main", "arch_from_hf")


def test_no_function_is_defined_twice():
    """One function per job: a module-level function name appears in one module only (two copies of
    ``_first_line`` and of a free-port picker had drifted apart before)."""
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in PROTOCOL_FUNCTIONS:
                where.setdefault(node.name, []).append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, twice


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks above would catch what they are for (a hand-made graph, not the package)."""
    assert _layer("megamarl.config") < _layer("megamarl.rollout.pool") < _layer("megamarl.trainer")
    assert _resolve("megamarl.config.RunConfig") == "megamarl.config"
    assert any(t == "megamarl.config" for t, _, _, _ in IMPORTS["megamarl.runtime.configure"])


# The two rooms that regrow because they are the default home of anything new (issue 42): the
# worker is the policy update (forward layouts in rl/forward.py, micro-batching in
# rl/micro_batches.py, the critic and the reference model in their own modules); the trainer is the
# loop (the run's parts built by run.py, saves by runtime/checkpointer.py, pushes by
# driver/engine_pushes.py, evaluations by driver/evaluator.py).
ROOM_LIMITS = {"rl/worker.py": 450, "trainer.py": 250}


@pytest.mark.parametrize("path", sorted(ROOM_LIMITS))
def test_the_rooms_that_regrow_stay_within_their_size(path):
    lines = (PACKAGE / path).read_text().count("\n")
    assert lines <= ROOM_LIMITS[path], f"{path} has {lines} lines (limit {ROOM_LIMITS[path]}): give the new concern a module"
