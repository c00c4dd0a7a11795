"""The packages' layering, read from the source with `ast` (nothing is imported).

The layers, lowest first; a module may import its own layer and the layers below it, never
one above (imports inside functions and under ``TYPE_CHECKING`` count too: a function's
import is a dependency all the same, only a later one):

1. ``gpulab.extensions``: the notebook and replica side (and ``gpulab`` itself, which only
   holds ``%load_ext gpulab``); nothing of ``gpulab.hub`` or ``gpulab.spawner``.
   ``gpulab.extensions.contract`` (the job contract both sides share) is the standard
   library alone.
2. ``gpulab.hub.db`` (``gpulab.hub``'s own ``__init__`` sits here)
3. ``gpulab.hub.quota``
4. the substrate, two siblings: ``gpulab.hub.machine`` (one machine's accounts, cgroups,
   sandboxes, safe files, GPU inventory and usage) and ``gpulab.hub.cluster`` (user
   namespaces, Kubernetes and Kueue objects, the Kueue mirror)
5. the two things that stand on it, siblings: ``gpulab.spawner`` (notebook servers) and
   ``gpulab.hub.jobs`` (training jobs)
6. ``gpulab.hub.migrations`` (Alembic's scripts need every table)
7. ``gpulab.hub.service``
8. ``gpulab.hub.deploy`` (with ``gpulab.hub.kubeconfig`` and ``gpulab.hub.oidc``, the names
   configurations use, public re-exports of deploy's); deploy may also import the package
   ``gpulab.hub.service`` itself, whose ``__init__`` holds constants only
9. ``gpulab.hub.cli``

Siblings do not import each other, either way: nothing under ``gpulab.hub.jobs`` imports
``gpulab.spawner`` and nothing under ``gpulab.spawner`` imports ``gpulab.hub.jobs`` (what
both need lives below them), and likewise ``machine`` and ``cluster``.

And no two modules import each other, directly or round a longer circle.

Where the modules are: pyproject.toml's ``[tool.setuptools.package-dir]`` (``gpulab.hub`` is
the folder ``hub/``, and so on).
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: the layers, lowest first: (name, the module prefixes it holds)
LAYERS = [
    ("extensions", ("gpulab.extensions",)),
    ("db", ("gpulab.hub.db",)),
    ("quota", ("gpulab.hub.quota",)),
    ("machine", ("gpulab.hub.machine",)),
    ("cluster", ("gpulab.hub.cluster",)),
    ("spawner", ("gpulab.spawner",)),
    ("jobs", ("gpulab.hub.jobs",)),
    # Alembic's scripts, loaded by path (`gpulab.hub.db.alembic_config`), read every table
    ("migrations", ("gpulab.hub.migrations",)),
    ("service", ("gpulab.hub.service",)),
    ("deploy", ("gpulab.hub.deploy", "gpulab.hub.kubeconfig", "gpulab.hub.oidc")),
    ("cli", ("gpulab.hub.cli",)),
]
#: layers side by side: neither imports the other (the list's order between them means nothing)
SIBLINGS = [("machine", "cluster"), ("spawner", "jobs")]
#: packages in a layer by themselves, not with their sub-packages
EXACT = {"gpulab": "extensions", "gpulab.hub": "db"}
#: (importing layer, imported module) allowed across the rule
EXCEPTIONS = {("deploy", "gpulab.hub.service")}
#: modules that may import the standard library alone
STDLIB_ONLY = ("gpulab.extensions.contract",)


def _package_dirs() -> dict[str, Path]:
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {pkg: ROOT / folder
            for pkg, folder in conf["tool"]["setuptools"]["package-dir"].items()}


def _modules() -> dict[str, Path]:
    """Every module of gpulab: dotted name -> file (a package by its ``__init__.py``)."""
    dirs = _package_dirs()
    found: dict[str, Path] = {}
    for pkg, folder in dirs.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            # a folder mapped to another package of its own is that package's
            if any(str(folder / Path(*parts[:i])) in {str(d) for d in dirs.values()}
                   for i in range(1, len(parts))):
                continue
            if "templates" in parts[:-1]:  # data (gpulab_config.py is copied for operators)
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([pkg, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, anywhere in it; relative imports resolved,
    ``from X import Y`` counted as ``X.Y`` where that is a module."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            if subs:
                out += [(node.lineno, s) for s in subs]
                if len(subs) < len(node.names):
                    out.append((node.lineno, target))
            else:
                out.append((node.lineno, target))
    return out


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int | None:
    """Index in `LAYERS` of the module's layer: its longest matching prefix decides."""
    if module in EXACT:
        return [name for name, _ in LAYERS].index(EXACT[module])
    best, index = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    return index


def _where(name: str, line: int) -> str:
    return f"{MODULES[name].relative_to(ROOT)}:{line}"


def test_every_module_has_a_layer():
    assert MODULES, "no modules found: is pyproject.toml's package-dir read right?"
    assert [m for m in MODULES if _layer(m) is None] == []


@pytest.mark.parametrize("layer", [name for name, _ in LAYERS])
def test_imports_go_only_to_lower_layers(layer):
    mine = LAYERS.index(next(entry for entry in LAYERS if entry[0] == layer))
    wrong = []
    for name, imports in IMPORTS.items():
        if _layer(name) != mine:
            continue
        for line, target in imports:
            if not (target == "gpulab" or target.startswith("gpulab.")):
                continue
            theirs = _layer(target)
            if theirs is None or _siblings(mine, theirs):  # test_siblings_stay_apart
                continue
            if theirs > mine and (layer, target) not in EXCEPTIONS:
                wrong.append(f"{_where(name, line)}: {name} ({layer}) imports {target} "
                             f"({LAYERS[theirs][0]}, a layer above)")
    assert wrong == [], "\n".join(wrong)


def _siblings(a: int, b: int) -> bool:
    names = {LAYERS[a][0], LAYERS[b][0]}
    return any(names == set(pair) for pair in SIBLINGS)


@pytest.mark.parametrize("pair", SIBLINGS, ids="-".join)
def test_siblings_stay_apart(pair):
    """Neither sibling imports the other: ``gpulab.hub.jobs`` never imports
    ``gpulab.spawner``, nor the reverse; ``machine`` and ``cluster`` likewise."""
    index = [name for name, _ in LAYERS]
    wrong = []
    for mine, theirs in (pair, pair[::-1]):
        for name, imports in IMPORTS.items():
            if _layer(name) != index.index(mine):
                continue
            wrong += [f"{_where(name, line)}: {name} ({mine}) imports {target} ({theirs})"
                      for line, target in imports if _layer(target) == index.index(theirs)]
    assert wrong == [], "\n".join(wrong)


@pytest.mark.parametrize("module", STDLIB_ONLY)
def test_stdlib_only(module):
    wrong = [f"{_where(module, line)}: {target}" for line, target in IMPORTS[module]
             if target.split(".")[0] not in sys.stdlib_module_names
             and target.split(".")[0] != "__future__"]
    assert wrong == [], "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {name: {t for _, t in imports if t in MODULES and t != name}
             for name, imports in IMPORTS.items()}
    cycles = _cycles(graph)
    lines = []
    for component in cycles:
        members = set(component)
        lines.append(" <-> ".join(component) + ": " + "; ".join(
            f"{_where(a, line)} imports {t}" for a in component
            for line, t in IMPORTS[a] if t in members and t != a))
    assert cycles == [], "\n".join(lines)


def test_the_rules_catch_what_they_should():
    """The checks themselves: a made-up cycle is found, layers are told apart."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    names = [n for n, _ in LAYERS]
    assert names[_layer("gpulab.hub.cli.main")] == "cli"
    assert names[_layer("gpulab.hub.kubeconfig")] == "deploy"
    assert names[_layer("gpulab.hub")] == "db"
    assert names[_layer("gpulab.extensions.contract")] == "extensions"
    assert names[_layer("gpulab")] == "extensions"
    assert names[_layer("gpulab.spawner.mixin")] == "spawner"
    assert names[_layer("gpulab.hub.machine.cgroups")] == "machine"
    assert names[_layer("gpulab.hub.cluster.kueuemirror")] == "cluster"
    assert _siblings(names.index("jobs"), names.index("spawner"))
    assert not _siblings(names.index("jobs"), names.index("cluster"))
    assert _layer("gpulab.hub.elsewhere") is None  # a new hub module must be given a layer
