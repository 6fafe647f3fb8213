"""The package's structure, read from its source: no import cycles, no import upwards, no module over ~400 lines,
and a typed public API.

Every ``import`` statement counts, a lazy one inside a function or under ``if TYPE_CHECKING:`` included: a cycle
broken by deferring one side's import is still a cycle a reader has to hold in their head.
"""

import ast
import inspect
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "lightning_zero"

# Each subpackage may import only from subpackages of a lower layer (and from itself). The root package
# (lightning_zero/__init__.py) is the facade: it registers the strategies and nothing inside imports it.
LAYERS = {
    "comm": 0,
    "optim": 0,
    "training": 1,
    "pipeline": 1,
    "tensor_parallel": 1,
    "dp": 2,
    "zero": 3,
    "robust": 4,
    "byzantine": 5,
    "strategies": 6,
    "fabric": 6,
    "demo": 6,
    "integrations": 7,
    "tools": 7,
    "netlab": 7,
}
ROOT_MAY_IMPORT = {"strategies", "fabric", "training"}
MAX_LINES = 420  # the guide's "~400 lines"

# The structure still owed (issue 34), so that CI holds the line while it is paid off: each module over MAX_LINES
# with the length it may not exceed. The list may only shrink: a module back under MAX_LINES fails
# test_the_debt_lists_only_what_is_still_owed until it leaves the list.
LONG_MODULES: dict[str, int] = {}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(module: str, path: pathlib.Path) -> set[str]:
    """The package's modules that ``module`` imports, resolved to the module (not the name) imported."""
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base.pop()
                base = base[: len(base) - node.level + 1]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            names = [f"{source}.{alias.name}" for alias in node.names]
        for name in names:
            if name.split(".")[0] != "lightning_zero":
                continue
            while name not in MODULES:  # ``from pkg.mod import func``: the module is pkg.mod
                name = name.rsplit(".", 1)[0]
            if name != module:
                targets.add(name)
    return targets


GRAPH = {module: _imported(module, path) for module, path in MODULES.items()}


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_sees_a_lazy_cycle():
    # The finder itself must be able to fail: a two-module cycle and a three-module one.
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert _cycles(graph) == [["a", "b"], ["c", "d", "e"]]


def test_import_reader_sees_lazy_and_relative_imports(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from .ring import x\n\ndef f():\n    from lightning_zero.dp import reducer\n")
    found = _imported("lightning_zero.comm.collectives", path)
    assert found == {"lightning_zero.comm.ring", "lightning_zero.dp.reducer"}


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_debt_lists_only_what_is_still_owed():
    paid = {m: n for m, n in LONG_MODULES.items() if len(MODULES[m].read_text().splitlines()) <= MAX_LINES}
    assert paid == {}, "modules back under MAX_LINES: remove them from LONG_MODULES"


def test_every_subpackage_has_a_layer():
    packages = {_package(module) for module in MODULES} - {None}
    assert packages == set(LAYERS), f"give {sorted(packages - set(LAYERS))} a layer in LAYERS"


def test_no_import_runs_upwards():
    upward = []
    for module, targets in sorted(GRAPH.items()):
        source = _package(module)
        for target in sorted(targets):
            into = _package(target)
            if into is None:
                upward.append(f"{module} imports the package root")
            elif source is None:
                if into not in ROOT_MAY_IMPORT:
                    upward.append(f"the package root imports {target}")
            elif into != source and LAYERS[into] >= LAYERS[source]:
                upward.append(f"{module} (layer {LAYERS[source]}) imports {target} (layer {LAYERS[into]})")
    assert upward == []


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_length(module):
    lines, limit = len(MODULES[module].read_text().splitlines()), LONG_MODULES.get(module, MAX_LINES)
    assert lines <= limit, f"{MODULES[module].relative_to(PACKAGE.parent)} has {lines} lines (at most {limit})"


def _untyped(function: object) -> list[str]:
    """The parameters of ``function`` without an annotation, and ``"return"`` if its return has none."""
    signature = inspect.signature(function)  # type: ignore[arg-type]
    missing = [
        name
        for name, parameter in signature.parameters.items()
        if name not in ("self", "cls") and parameter.annotation is inspect.Parameter.empty
    ]
    if signature.return_annotation is inspect.Signature.empty:
        missing.append("return")
    return missing


def test_the_public_api_is_typed():
    """Every name of ``lightning_zero.__all__``: a function's signature, a class's ``__init__`` and the public methods
    it defines itself, fully annotated (``py.typed`` promises it)."""
    import lightning_zero

    untyped = {}
    for name in lightning_zero.__all__:
        obj = getattr(lightning_zero, name)
        if inspect.isclass(obj):
            functions = {f"{name}.__init__": obj.__init__} if "__init__" in vars(obj) else {}
            functions |= {
                f"{name}.{attr}": value
                for attr, value in vars(obj).items()
                if inspect.isfunction(value) and not attr.startswith("_")
            }
        elif inspect.isfunction(obj):
            functions = {name: obj}
        else:
            continue
        for qualname, function in functions.items():
            if missing := _untyped(function):
                untyped[qualname] = missing
    assert untyped == {}
    assert _untyped(lambda x, y=1: x) == ["x", "y", "return"]  # the check itself can fail
