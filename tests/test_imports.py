"""The project's import graph: no module imports, directly or through others, a module that imports it, and no
module imports another's underscore names. Every import counts: at the top, inside functions and under
`TYPE_CHECKING` alike. A package's `__init__` re-exporting its modules is the package's own import, not a module's."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the folders installed as specjax.* (pyproject.toml's package-dir)
PACKAGES = {"specjax": "specjax", "kernels": "specjax.kernels", "stores": "specjax.stores", "eval": "specjax.eval",
            "configs": "specjax.configs"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([package, *parts])] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict) -> list[tuple[str, str]]:
    """(module imported, name imported from it or "") for every import of the project's modules in `path`."""
    out = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "specjax"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] == "specjax":
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    out.append((full, "") if full in known else (base, alias.name))
    return out


def owner(module: str, known: dict) -> str | None:
    """The project module `module` is or lies in."""
    while module and module not in known:
        module = module.rpartition(".")[0]
    return module or None


def graph() -> dict[str, set[str]]:
    known = modules()
    edges = {name: set() for name in known}
    for name, path in known.items():
        if path.name == "__init__.py":
            continue
        for module, _ in imports(name, path, known):
            target = owner(module, known)
            if target is not None and target != name and known[target].name != "__init__.py":
                edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_the_engines_imports():
    edges = graph()
    assert {"specjax.engine.layer_io", "specjax.engine.identify", "specjax.connector"} <= edges["specjax.engine.engine"]
    assert "specjax.stores.prefetch" in edges["specjax.connector"]


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    assert cycles(graph()) == []


def test_no_module_imports_another_modules_underscore_names():
    known = modules()
    private = [(name, module, imported) for name, path in known.items()
               for module, imported in imports(name, path, known)
               if any(part.startswith("_") and not part.startswith("__")
                      for part in [*module.split("."), imported] if part)]
    assert private == []


def test_a_requests_reads_see_the_engines_read_path_not_the_engine():
    assert "specjax.engine.engine" not in graph()["specjax.engine.layer_io"]


def test_the_connector_sees_the_store_and_no_model_or_engine():
    edges = graph()
    below = set()
    todo = ["specjax.connector"]
    while todo:  # everything the connector imports, directly or through others
        for module in edges.get(todo.pop(), ()):
            if module not in below:
                below.add(module)
                todo.append(module)
    assert "specjax.stores.prefetch" in below
    assert not [m for m in below if m.startswith(("specjax.engine", "specjax.models", "specjax.eval"))]


def _below(edges: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    below, todo = set(), [start]
    while todo:
        for module in edges.get(todo.pop(), ()):
            if module not in below:
                below.add(module)
                todo.append(module)
    return below


def test_the_engine_reaches_the_stores_only_through_the_connector():
    edges = graph()
    engine = [name for name in edges if name.startswith("specjax.engine.")]
    assert "specjax.engine.layer_io" in engine and "specjax.engine.engine" in engine
    known = modules()
    direct = {name: sorted(m for m, _ in imports(name, known[name], known) if m.split(".")[:2] == ["specjax", "stores"])
              for name in engine}  # the package's own `__init__` counts too
    assert {name: found for name, found in direct.items() if found} == {}
    assert all("specjax.stores.prefetch" in _below(edges, name) for name in ("specjax.engine.layer_io",
                                                                                "specjax.engine.engine"))


def test_the_stores_see_no_model_no_engine_and_no_connector():
    edges = graph()
    known = modules()
    stores = [name for name in known if name.split(".")[:2] == ["specjax", "stores"]]
    reached = set().union(*(_below(edges, name) for name in stores), *(
        {m for m, _ in imports(name, known[name], known)} for name in stores))
    assert not [m for m in reached if m.startswith(("specjax.engine", "specjax.models", "specjax.eval",
                                                    "specjax.connector"))]
