"""The package's import graph: no circles, and no import from a lower floor to a higher one.

Every `import` and `from ... import` in every module of deltafin/ counts, those inside functions (lazy imports)
and under `if TYPE_CHECKING:` included. Not seen, by design: names imported by string (`importlib.import_module`
in deltafin/families/__init__.py and deltafin/markup/__init__.py loading their own modules; Hydra `_target_`s in
conf/, resolved by the entry).

deltafin.markup is a floor of its own, below grammar and prompt and above protocol: a markup is
plain parsing code and structural tags as plain data (the JSON whitespace bound comes from protocol.sampling),
so it needs nothing above protocol, while families and serving pick markups and grammar's GBNF writer
(grammar/gbnf/xml_style.py) reads their argument styles.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "deltafin"

#: The floors of docs/architecture.md, top first. A module may import its own floor and the floors below it.
FLOORS: list[set[str]] = [
    # entry points: the server, the tiny-model writer; and what tests and bench use to run the server
    {"deltafin.__main__", "deltafin.cli", "deltafin.tiny", "deltafin.testing"},
    {"deltafin.app"},  # ASGI wiring
    {"deltafin.serving"},  # one module per endpoint family
    {"deltafin.rules", "deltafin.families", "deltafin.engine"},
    {"deltafin.grammar", "deltafin.prompt"},  # constrained decoding; chat formats, the template sandbox
    # how models write reasoning and tool calls, one module per markup (parser, structural tag, GBNF style)
    {"deltafin.markup"},
    {
        "deltafin.protocol",
        "deltafin.errors",
        "deltafin.config",
        "deltafin.logging",
        "deltafin.metrics",
        "deltafin.token_codec",
        "deltafin",
    },
]

#: The engine's rooms (docs/architecture.md), top first, the same way: a room may import its own floor and the
#: floors below it. `deltafin.engine` itself (interface, events, stream, front, admission, memo) is the contract.
ENGINE_FLOORS: list[set[str]] = [
    {"deltafin.engine.local", "deltafin.engine.upstream"},  # the engines
    {"deltafin.engine.weights"},  # loading: builds models from the rooms below
    # the expert pool; Llama decode steps; Deltafin's own model classes (Kimi K3)
    {"deltafin.engine.experts", "deltafin.engine.llama", "deltafin.engine.models"},
    {"deltafin.engine.kv", "deltafin.engine.quant"},  # caches; weight formats
    {"deltafin.engine.kernels"},  # C kernels
    {"deltafin.engine.text"},  # tokens to text
    {"deltafin.engine"},  # the contract
]

#: Known violations; an entry that no longer occurs fails the test,
#: so this list only shrinks.
ALLOWED_CIRCLES: set[frozenset[str]] = set()
ALLOWED_UPWARD: set[tuple[str, str]] = set()


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in PACKAGE.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The deltafin module `name` refers to (a module, else the package it names); None outside deltafin."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path) -> set[str]:
    found: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from pkg import name`: name is a module of pkg, or something pkg defines
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        found.update(t for t in map(resolve, targets) if t is not None and t != module)
    return found


GRAPH = {module: imports_of(module, path) for module, path in MODULES.items()}


def floor_of(module: str) -> int:
    unit = max((u for floor in FLOORS for u in floor if module == u or module.startswith(u + ".")), key=len)
    return next(i for i, floor in enumerate(FLOORS) if unit in floor)


def unit_of(module: str) -> str:
    return max((u for floor in FLOORS for u in floor if module == u or module.startswith(u + ".")), key=len)


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def without_allowed_upward(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in targets if (m, t) not in ALLOWED_UPWARD} for m, targets in graph.items()}


def test_every_module_stands_on_a_floor():
    assert all(unit_of(module) for module in MODULES)


def test_no_import_runs_up_a_floor():
    upward = {(m, t) for m, targets in GRAPH.items() for t in targets if floor_of(t) < floor_of(m)}
    assert upward - ALLOWED_UPWARD == set(), "imports from a lower floor to a higher one"
    assert ALLOWED_UPWARD - upward == set(), "fixed: remove these from ALLOWED_UPWARD"


def test_no_circle_between_modules():
    found = set(circles(without_allowed_upward(GRAPH)))
    assert found - ALLOWED_CIRCLES == set(), "modules that import each other in a loop"
    assert ALLOWED_CIRCLES - found == set(), "fixed: remove these from ALLOWED_CIRCLES"


def test_no_circle_between_packages():
    units: dict[str, set[str]] = defaultdict(set)
    for module, targets in without_allowed_upward(GRAPH).items():
        units[unit_of(module)].update(unit_of(t) for t in targets if unit_of(t) != unit_of(module))
    assert circles(units) == []


def engine_floor_of(module: str) -> int:
    unit = max((u for floor in ENGINE_FLOORS for u in floor if module == u or module.startswith(u + ".")), key=len)
    return next(i for i, floor in enumerate(ENGINE_FLOORS) if unit in floor)


def test_no_import_runs_up_an_engine_room():
    inside = {
        m: {t for t in targets if t.startswith("deltafin.engine")}
        for m, targets in GRAPH.items()
        if m.startswith("deltafin.engine")
    }
    upward = {(m, t) for m, targets in inside.items() for t in targets if engine_floor_of(t) < engine_floor_of(m)}
    assert upward == set(), "imports from a lower engine room to a higher one"


def test_the_checker_sees_lazy_imports_and_resolves_modules():
    """A function-level import counts, and `from deltafin.x import y` names module y when there is one."""
    assert "deltafin.engine.weights.loader" in GRAPH["deltafin.cli"]  # imported inside a function
    assert "deltafin.config.schema" in GRAPH["deltafin.config.compose"]
    assert "deltafin.families" in GRAPH["deltafin.rules.pipeline"]  # names the package itself
