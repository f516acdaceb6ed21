"""The import graph: no cycles, and no module imports from a floor above its own (ARCHITECTURE.md).

Imports inside functions count too: a lazy import is still a dependency.
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Floors, bottom to top. A module's floor is that of the longest prefix listed.
FLOORS = {
    # 0 foundation: types, the problem description, device facts, switches, the reference
    "tileq.errors": 0, "tileq._runtime": 0, "tileq.settings": 0, "tileq.dtypes": 0,
    "tileq.problem": 0, "tileq.device": 0, "tileq.reference": 0, "tileq.quant": 0,
    "tileq.prepacked": 0, "tileq.testing": 0, "tileq.version": 0, "tileq.reference_grouped": 0,
    # 1 kernels and launchers (execute a plan, decide nothing) and the kernel catalog's names
    "tileq.kernels": 1, "tileq.catalog": 1,
    # 2 dispatch: every routing decision
    "tileq.dispatch": 2,
    # 3 the public functions
    "tileq.api": 3, "tileq.api_prepacked": 3, "tileq.api_grouped": 3, "tileq.activation": 3, "tileq.warmup": 3,
    "tileq.qk_rope": 3, "tileq.attention": 3,
    # 4 models: the layer, custom ops, transformers, checkpoints, the package's own namespace
    "tileq.quant_linear": 4, "tileq.ops": 4, "tileq.nn": 4, "tileq.integrations": 4,
    "tileq.formats": 4, "tileq.moe": 4, "tileq.distributed": 4, "tileq": 4,
    # 5 tools: the command line, builds, tuning, benchmarks, the demo, test helpers
    "tileq.cli": 5, "tileq.__main__": 5, "tileq.commands": 5, "tileq.build": 5, "tileq.tune": 5,
    "tileq.bench": 5, "tileq.demo": 5, "tileq.demo_model": 5, "tileq.sass": 5,
}


def floor(module: str) -> int:
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        key = ".".join(parts[:i])
        if key in FLOORS:
            return FLOORS[key]
    raise AssertionError(f"{module}: no floor in tests/test_layering.py's FLOORS")


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "tileq").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                   for n in ast.walk(node)}  # annotations only: no import at run time
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tileq"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "tileq":
                continue
            for a in node.names:  # "from pkg import submodule" depends on the submodule
                sub = f"{target}.{a.name}"
                found.add(sub if sub in known else target)
    return {t for t in found if t != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: {t for t in imports(name, path, known) if t in known} for name, path in mods.items()}


def test_every_module_has_a_floor():
    for name in modules():
        floor(name)


def test_no_import_up_the_floors():
    bad = [f"{m} (floor {floor(m)}) imports {t} (floor {floor(t)})"
           for m, ts in graph().items() for t in sorted(ts) if floor(t) > floor(m)
           # a package's __init__ may name its own submodules (re-exports)
           and not t.startswith(m + ".")]
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    g = graph()
    # Tarjan's strongly connected components; a package importing its own submodules is no cycle.
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def edges(v):  # (the root package's own namespace is no exception: its modules must not import it)
        return [w for w in g[v] if v == "tileq" or not w.startswith(v + ".")]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)
