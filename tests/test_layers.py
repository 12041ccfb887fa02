"""The layers of docs/architecture.md, checked against every import in the package.

Imports point one way: data model → renderers / engine / envs / trainer → harness → rl / agents → jobs
→ cli, with sim, lint and bench beside the harness, and trackers on the data model alone (jobs and cli
open them). vLLM is imported only in engine/, torch only where
models run (engine/, trainer/, bench/).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "verbatim"

DATA = {"datamodel", "errors", "paths", "prefix_cache", "durable", "loopback"}
ALLOWED: dict[str, set[str]] = {
    # the data model: plain types, errors and where files are; imports nothing above it
    **{room: DATA for room in DATA},
    "renderers": DATA,
    "engine": DATA,
    "envs": DATA,
    "trainer": DATA,
    "trackers": DATA,
    "harness": DATA | {"renderers", "engine", "envs", "trainer"},
    # the RL loop: plays through the harness, learns through the trainer
    "rl": DATA | {"renderers", "engine", "envs", "trainer", "harness"},
    "agents": DATA | {"renderers", "engine", "envs", "harness"},
    # a run composed from one config (the CLI, a torchrun worker, a user's script): may play an agent
    "jobs": DATA | {"renderers", "engine", "envs", "trainer", "harness", "rl", "agents", "trackers"},
    "sim": DATA | {"engine", "harness"},
    "lint": DATA | {"engine", "harness"},
    # the benchmarks: a training run's goes through jobs/ as `verbatim train`'s does
    "bench": DATA | {"renderers", "engine", "envs", "trainer", "harness", "rl", "agents", "jobs", "trackers", "sim",
                     "lint"},
    "view": DATA | {"renderers", "engine", "envs", "trainer", "harness", "lint"},
    "cli": DATA | {"renderers", "engine", "envs", "trainer", "harness", "rl", "agents", "jobs", "sim", "lint",
                  "bench", "view", "trackers"},
}
THIRD_PARTY = {"vllm": {"engine"}, "torch": {"engine", "trainer", "bench"}}


def _room(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def test_every_room_is_placed_in_a_layer() -> None:
    rooms = {_room(p) for p in MODULES}
    assert rooms <= set(ALLOWED), f"rooms missing from the layer map: {rooms - set(ALLOWED)}"


@pytest.mark.parametrize("module", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(module: Path) -> None:
    room = _room(module)
    for name in _imports(module):
        top, _, rest = name.partition(".")
        if top == "verbatim" and rest:
            target = rest.split(".")[0]
            assert target == room or target in ALLOWED[room], f"{room} may not import verbatim.{target} ({name})"
        elif top in THIRD_PARTY:
            assert room in THIRD_PARTY[top], f"{top} is imported only in {sorted(THIRD_PARTY[top])}, not {room}"


def test_no_relative_imports() -> None:
    """Absolute imports only, so a module says which room it reads from."""
    relative = [str(p.relative_to(PACKAGE)) for p in MODULES
                if any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(ast.parse(p.read_text())))]
    assert relative == []


def test_the_architecture_picture_names_every_room() -> None:
    picture = (PACKAGE.parent.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    rooms = {_room(p) for p in MODULES}
    missing = [r for r in sorted(rooms) if f"{r}/" not in picture and f"{r}.py" not in picture]
    assert missing == [], f"docs/architecture.md does not place {missing}"


# Rooms whose modules may load torch when imported: where models run, and what starts them; and the training
# loop itself, which drives the learner (its checkpoints, its weights). The rest of rl/ is plain data and files.
LOADS_TORCH = {"engine", "trainer", "bench", "jobs", "cli"}
TRAINING_LOOP = {"rl/train.py"}


def _top_level_imports(path: Path) -> set[str]:
    """What importing ``path`` imports: its module-level imports (a function's own import waits for a call),
    each ``from M import N`` also as ``M.N`` (N may be a module)."""
    found = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _module_name(path: Path) -> str:
    return ".".join(("verbatim", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def test_importing_a_module_outside_the_model_rooms_never_loads_torch() -> None:
    """rl/train_step.py's pure functions once loaded torch for one dataclass (through trainer.learner)."""
    graph = {_module_name(p): _top_level_imports(p) for p in PACKAGE.rglob("*.py")}

    def path_to_torch(name: str, seen: set[str]) -> list[str] | None:
        seen.add(name)
        for target in sorted(graph[name]):
            if target.split(".")[0] == "torch":
                return [name, target]
            if target in graph and target not in seen:
                rest = path_to_torch(target, seen)
                if rest:
                    return [name, *rest]
        return None

    loading = {}
    for path in MODULES:
        if _room(path) in LOADS_TORCH or str(path.relative_to(PACKAGE)) in TRAINING_LOOP:
            continue
        chain = path_to_torch(_module_name(path), set())
        if chain:
            loading[str(path.relative_to(PACKAGE))] = " → ".join(chain)
    assert loading == {}
