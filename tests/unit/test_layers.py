"""The package's layers point one way (docs/style.md "Layers", docs/design-notes.md "Layers"), read from
the source with ``ast``: every import of a megamarl module, at module level or inside a function, goes to
the importing module's own layer or below, and the test counts the upward ones (0); no two files import
each other, directly or round a circle; and no function imports a megamarl module (a local import is a
sign of code in the wrong room). Imports under ``if TYPE_CHECKING:`` count for the layers, not for
circles (they never run). Names: no file's basename twice in the package, every env under
``orchestration/envs/``, every style rule the code cites written in docs/style.md.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "megamarl"

# Lowest first, one floor per package (issue 42: the five coarse layers let four upward imports
# through). A module may import its own floor and those below it. docs/design-notes.md lists this map
# ("Layers: one floor per package"); test_the_layer_map_is_written_down keeps the two equal.
LAYERS = {
    "errors": 0,
    "registry": 0,
    "config_loader": 0,
    "config_sections": 0,
    "config": 1,
    "parallel": 2,
    "models": 3,
    "rl": 4,
    "rollout": 5,
    "orchestration": 6,
    "runtime": 7,
    "planning": 8,
    "driver": 9,
    "trainer": 10,
    "run": 10,
    "cli": 11,
    "vllm_plugins": 11,
}
DESIGN_NOTES = PACKAGE.parent / "docs" / "design-notes.md"


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
    in_function = {
        id(n)
        for f in ast.walk(tree)
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
        for n in ast.walk(f)
    }
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
        targets = {
            t for t in map(_resolve, (n for n in names if n.startswith("megamarl"))) if t and t != module
        }
        for target in sorted(targets):
            found.append((target, node.lineno, id(node) in in_function, id(node) in typing_only))
    return found


IMPORTS = {module: _imports(module) for module in MODULES}


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if m != "megamarl" and _layer(m) is None)
    assert not missing, f"add these to LAYERS (and docs/design-notes.md): {missing}"


def _upward() -> list[str]:
    return [
        f"{module}:{line} imports {target} (layer {_layer(target)} > {_layer(module)})"
        for module, imports in IMPORTS.items()
        if module != "megamarl"
        for target, line, _, _ in imports
        if _layer(target) > _layer(module)
    ]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "megamarl"))
def test_imports_point_down(module):
    upward = [line for line in _upward() if line.startswith(f"{module}:")]
    assert not upward, "\n".join(upward)


def test_upward_imports_are_counted_and_there_are_none():
    """The whole package at once: the number of upward imports across the floor map is 0."""
    upward = _upward()
    assert len(upward) == 0, f"{len(upward)} upward imports:\n" + "\n".join(upward)


def test_the_ground_floor_imports_no_megamarl_module():
    """Floor 0 (errors, registry, config_loader, config_sections) stands on nothing of the package."""
    ground = {m: [t for t, _, _, _ in IMPORTS[m]] for m in MODULES if _layer(m) == 0}
    assert ground and not any(ground.values()), ground


def test_the_layer_map_is_written_down():
    """docs/design-notes.md shows the floors this test checks (one line per floor, lowest first)."""
    text = DESIGN_NOTES.read_text()
    block = text[text.index("## Layers: one floor per package") :]
    block = block[block.index("```") + 3 :]
    block = block[: block.index("```")]
    written = {}
    for line in block.strip().splitlines():
        floor, names = line.split(None, 1)
        for name in names.split("  ")[0].split(","):
            written[name.strip().removesuffix("/").removesuffix(".py")] = int(floor)
    assert written == LAYERS


def test_no_function_imports_a_megamarl_module():
    local = [
        f"{module}:{line} imports {target} inside a function"
        for module, imports in IMPORTS.items()
        for target, line, in_function, _ in imports
        if in_function
    ]
    assert not local, "\n".join(local)


def test_no_import_circles_between_files():
    graph = {
        m: sorted({t for t, _, _, typing_only in imports if not typing_only})
        for m, imports in IMPORTS.items()
    }
    circles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                circles.append(
                    " -> ".join(path[path.index(nxt) :] + [node, nxt]) if nxt in path else f"{node} -> {nxt}"
                )
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert not circles, "\n".join(circles)


# Module-level functions that several modules define on purpose: a CLI's entry point and the model
# families' protocol function (models/families.py dispatches to each family's).
PROTOCOL_FUNCTIONS = ("main", "arch_from_hf")


def test_no_function_is_defined_twice():
    """One function per job: a module-level function name appears in one module only (two copies of
    ``_first_line`` and of a free-port picker had drifted apart before)."""
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and node.name not in PROTOCOL_FUNCTIONS
            ):
                where.setdefault(node.name, []).append(module)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, twice


def test_the_checker_sees_a_circle_and_an_upward_import():
    """The checks above would catch what they are for (a hand-made graph, not the package)."""
    assert _layer("megamarl.config") < _layer("megamarl.rollout.pool") < _layer("megamarl.trainer")
    assert _resolve("megamarl.config.RunConfig") == "megamarl.config"
    assert any(t == "megamarl.config" for t, _, _, _ in IMPORTS["megamarl.cli.configure"])


# The two rooms that regrow because they are the default home of anything new (issue 42): the
# worker is the policy update (forward layouts in rl/forward.py, micro-batching in
# rl/micro_batches.py, the critic and the reference model in their own modules); the trainer is the
# loop (the run's parts built by run.py, saves by runtime/checkpointer.py, pushes by
# driver/engine_pushes.py, evaluations by driver/evaluator.py).
ROOM_LIMITS = {"rl/worker.py": 450, "trainer.py": 250}


@pytest.mark.parametrize("path", sorted(ROOM_LIMITS))
def test_the_rooms_that_regrow_stay_within_their_size(path):
    lines = (PACKAGE / path).read_text().count("\n")
    assert lines <= ROOM_LIMITS[path], (
        f"{path} has {lines} lines (limit {ROOM_LIMITS[path]}): give the new concern a module"
    )


# Basenames that may appear in several folders, with the reason.
SHARED_BASENAMES = {"__init__.py": "a package's own module"}


def test_no_basename_twice():
    """One file per name: ``placement.py`` (parallel/, rollout/), ``checkpoint.py`` (models/, runtime/),
    ``registry.py`` (megamarl/, models/) and ``lora.py`` (models/, rollout/engines/) each named two
    different things; a reader, a traceback and ``git log --follow`` should not have to tell which."""
    where: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        where.setdefault(path.name, []).append(str(path.relative_to(PACKAGE)))
    twice = {
        name: sorted(paths)
        for name, paths in where.items()
        if len(paths) > 1 and name not in SHARED_BASENAMES
    }
    assert not twice, twice


def _registers_an_env(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.Call) and ast.unparse(node.func) == "ENVS.register" for node in ast.walk(tree)
    )


def test_every_env_lives_under_orchestration_envs():
    """A module that registers an env (``@ENVS.register``) sits in orchestration/envs/, with the
    hooks of the games it wraps (games.py, pettingzoo_text.py, pettingzoo_games.py)."""
    envs = PACKAGE / "orchestration" / "envs"
    registering = [path for path in PACKAGE.rglob("*.py") if _registers_an_env(ast.parse(path.read_text()))]
    assert len(registering) >= 8  # code, math, planning, search, signalling, sudoku, latency, pettingzoo
    outside = [str(p.relative_to(PACKAGE)) for p in registering if envs not in p.parents]
    assert not outside, outside
    beside = sorted(
        p.name
        for p in (PACKAGE / "orchestration").glob("*.py")
        if "pettingzoo" in p.name or "games" in p.name or "envs" in p.name
    )
    assert not beside, beside


def test_the_style_rules_the_code_cites_are_written_in_the_repository():
    """A citation of a style rule (``docs/style.md "Layers"``) names a heading docs/style.md has; four
    files cited an upper-case style file that was never in the repository (issue 42)."""
    outside = "STYLE" + ".md"
    root = PACKAGE.parent
    headings = set(re.findall(r"^## (.+)$", (root / "docs" / "style.md").read_text(), flags=re.MULTILINE))
    cited: dict[str, list[str]] = {}
    for path in [*root.glob("megamarl/**/*.py"), *root.glob("scripts/**/*.py"), *root.glob("tests/**/*.py")]:
        text = path.read_text()
        assert outside not in text, (
            f"{path}: cites {outside}, which the repository does not have (docs/style.md)"
        )
        for match in re.finditer(r"docs/style\.md ((?:\"[^\"]+\"(?:, )?)+)", text):
            for name in re.findall(r'"([^"]+)"', match.group(1)):
                cited.setdefault(" ".join(name.split()), []).append(str(path.relative_to(root)))
    assert len(cited) >= 5, cited  # the pattern still matches how the code cites the rules
    missing = {name: paths for name, paths in cited.items() if name not in headings}
    assert not missing, missing
