"""The import graph (ARCHITECTURE.md, "Floors"): every module on a floor, imports only down the
floors, no cycle between modules or between packages, and the model layer above the API.

Imports inside functions count too: a lazy import is still a dependency. Only an
``if TYPE_CHECKING:`` block is exempt (annotations, no import at run time).
"""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

# Floors, bottom to top. A module's floor is that of its longest prefix listed; "tileq" alone is the
# package namespace (its __init__'s re-exports), never a prefix: a new module must be listed.
FLOORS = [
    ("foundation", ("tileq.errors", "tileq._runtime", "tileq.settings", "tileq.dtypes", "tileq.problem",
                    "tileq.device", "tileq.reference", "tileq.reference_grouped", "tileq.quant", "tileq.prepacked",
                    "tileq.testing", "tileq.version", "tileq.extensions")),
    ("kernels", ("tileq.kernels", "tileq.catalog")),  # launchers execute a plan, decide nothing
    ("dispatch", ("tileq.dispatch",)),  # every routing decision
    ("API", ("tileq.api", "tileq.api_prepacked", "tileq.api_grouped", "tileq.api_moe", "tileq.activation",
             "tileq.qk_rope", "tileq.attention", "tileq.warmup", "tileq.tracing")),
    ("layers", ("tileq.quant_linear", "tileq.ops", "tileq.nn", "tileq.moe")),
    ("models", ("tileq.integrations", "tileq.formats")),  # transformers integration, checkpoint formats
    ("distributed", ("tileq.distributed",)),
    ("namespace", ("tileq",)),
    ("tools", ("tileq.cli", "tileq.__main__", "tileq.commands", "tileq.argtypes", "tileq.build", "tileq.tune",
               "tileq.bench", "tileq.demo", "tileq.demo_model", "tileq.sass")),
]
FLOOR_OF = {prefix: i for i, (_, prefixes) in enumerate(FLOORS) for prefix in prefixes}
NAMES = [name for name, _ in FLOORS]

# The model layer and everything above it up to the namespace reach kernels and routing only
# through the API floor.
ABOVE_THE_API = range(NAMES.index("layers"), NAMES.index("namespace") + 1)
BELOW_THE_API = (NAMES.index("kernels"), NAMES.index("dispatch"))


def floor(module: str) -> int:
    if module == "tileq":
        return FLOOR_OF["tileq"]
    parts = module.split(".")
    for i in range(len(parts), 1, -1):
        key = ".".join(parts[:i])
        if key in FLOOR_OF:
            return FLOOR_OF[key]
    raise AssertionError(f"{module}: no floor in tests/test_layering.py's FLOORS")


def described(module: str) -> str:
    return f"{module} ({NAMES[floor(module)]})"


def package(module: str) -> str:
    """The top-level part of tileq a module belongs to ('nn', 'commands', ...; 'tileq': the namespace)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tileq"


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for p in (SRC / "tileq").rglob("*.py"):
        name = ".".join(p.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` bodies (an ``else:`` branch runs)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            out |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    is_pkg = path.name == "__init__.py"
    found = set()
    tree = ast.parse(path.read_text())
    typing_only = _typing_only(tree)
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


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g[v]:
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
                found.append(sorted(comp))

    for v in g:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_floor():
    for m in modules():
        floor(m)


def test_no_import_up_the_floors():
    bad = [f"{described(m)} imports {described(t)}"
           for m, ts in graph().items() for t in sorted(ts) if floor(t) > floor(m)
           # a package's __init__ may name its own submodules (re-exports)
           and not t.startswith(m + ".")]
    assert not bad, "\n".join(bad)


def test_no_module_cycles():
    g = graph()
    # A package importing its own submodules is no cycle; the namespace is no exception: tileq's
    # modules below it must not import it.
    edges = {v: {w for w in ts if v == "tileq" or not w.startswith(v + ".")} for v, ts in g.items()}
    found = cycles(edges)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_package_cycles():
    """Each top-level subpackage or module of tileq as one node: no two of them import each other,
    directly or around a loop, even on one floor."""
    g = graph()
    pkgs: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for m, ts in g.items():
        for t in ts:
            a, b = package(m), package(t)
            pkgs.setdefault(a, set())
            pkgs.setdefault(b, set())
            if a != b:
                pkgs[a].add(b)
                why.setdefault((a, b), f"{m} -> {t}")
    found = cycles(pkgs)
    assert not found, "\n".join(
        " <-> ".join(c) + ": " + "; ".join(why[a, b] for a in c for b in c if (a, b) in why) for c in found)


def test_the_model_layer_reaches_kernels_and_dispatch_only_through_the_api():
    direct = sorted(f"{m} -> {t}" for m, ts in graph().items() for t in ts
                    if floor(m) in ABOVE_THE_API and floor(t) in BELOW_THE_API)
    assert not direct, "imports of kernels/ or dispatch/ above the API floor (go through an API module):\n" + \
        "\n".join(direct)
