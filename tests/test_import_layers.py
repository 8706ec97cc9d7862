"""shardwise's import graph: no module imports another that imports it back, and no module
imports a package of a higher layer (docs/architecture.md "Layers").

Edges are read with `ast` from every `import` / `from ... import` of a shardwise module,
at module level or inside a function (a lazy import that closes a cycle is still a cycle).
`from shardwise.x import y` is an edge to `shardwise.x.y` when `y` is a submodule, else to
`shardwise.x` (a package's `__init__` re-exporting a name is an edge to the package).
Imports under `if TYPE_CHECKING:` never run and are left out: an annotation is not an
import. A strongly connected component of more than one module is a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import shardwise

SRC = Path(shardwise.__file__).resolve().parent


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package) for every module under the package `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", None)
            if name == "TYPE_CHECKING":
                skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same top-level package it imports."""
    mods = _modules(root)
    top = root.name

    def owner(name: str) -> str | None:  # the longest module prefix of a dotted name
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, (path, package) in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        here = mod if package else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names if a.name.split(".")[0] == top]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != top:
                    continue
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else owner(source)
                           for a in node.names]
            else:
                continue
            graph[mod] |= {t for t in targets if t and t != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _describe(graph: dict[str, set[str]], comp: list[str]) -> str:
    members = set(comp)
    return "\n".join(f"  {m} -> {', '.join(sorted(graph[m] & members))}" for m in comp)


def test_no_import_cycles() -> None:
    graph = import_graph(SRC)
    assert len(graph) > 100 and "shardwise.plan.memory" in graph  # the walk saw the package
    found = cycles(graph)
    assert not found, "import cycles in src/shardwise:\n" + "\n\n".join(_describe(graph, c) for c in found)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_the_checker_finds_lazy_submodule_and_package_cycles(tmp_path: Path) -> None:
    """The checker itself, on a package built here: a lazy import inside a function closes a
    cycle; `from pkg.sub import mod` is an edge to the submodule, `from pkg.sub import name`
    to the package `pkg.sub`; TYPE_CHECKING imports and absolute imports of other packages are
    no edges."""
    root = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "def f():\n    from pkg import b\n",
        "pkg/b.py": "from pkg.sub import c\n",
        "pkg/sub/__init__.py": "from pkg.sub.c import X\n",
        "pkg/sub/c.py": "import os\nX = 1\ndef g():\n    import pkg.a\n",
        "pkg/d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import e\n",
        "pkg/e.py": "from pkg.sub import X\nfrom . import d\n",
    })
    graph = import_graph(root)
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.c"}
    assert graph["pkg.d"] == set()
    assert graph["pkg.e"] == {"pkg.sub", "pkg.d"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.c"]]


# Bottom to top; a module may import its own layer and the ones below (docs/architecture.md "Layers").
# A name is a package (everything under it) or a top-level module.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("shardwise", "shardwise.errors", "shardwise.strict_json", "shardwise.numfmt", "shardwise.quiet",
              "shardwise.versions", "shardwise.console", "shardwise.cli_help")),
    ("config", ("shardwise.config",)),
    ("specs", ("shardwise.specs", "shardwise.catalog")),
    ("plan", ("shardwise.plan", "shardwise.doctor")),
    ("run", ("shardwise.run", "shardwise.data")),
    ("train/measure", ("shardwise.train", "shardwise.bench", "shardwise.ingest", "shardwise.emit")),
    ("cli", ("shardwise.cli",)),
)


def layer_of(module: str) -> int | None:
    """The layer index of a module: the layer naming it or the longest package above it."""
    best: tuple[int, int] | None = None
    for i, (_, names) in enumerate(LAYERS):
        for n in names:
            if (module == n or module.startswith(n + ".")) and (n != "shardwise" or module == n):
                if best is None or len(n) > best[1]:
                    best = (i, len(n))
    return None if best is None else best[0]


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in import_graph(SRC) if layer_of(m) is None)
    assert not missing, f"modules in no layer (add them to LAYERS and docs/architecture.md): {missing}"


def test_no_module_imports_a_higher_layer() -> None:
    graph = import_graph(SRC)
    up = sorted(f"  {m} ({LAYERS[layer_of(m)][0]}) -> {d} ({LAYERS[layer_of(d)][0]})"
                for m, deps in graph.items() for d in deps
                if layer_of(m) is not None and layer_of(d) is not None and layer_of(d) > layer_of(m))
    assert not up, "imports that run up the layers:\n" + "\n".join(up)


def test_the_layer_check_sees_a_lazy_upward_import(tmp_path: Path) -> None:
    """The checker, on a package built here: a lazy import from the config layer into train is
    an upward edge; the same import under TYPE_CHECKING is none."""
    root = _write(tmp_path, {
        "shardwise/__init__.py": "",
        "shardwise/config/__init__.py": "",
        "shardwise/config/schema.py": "def f():\n    from shardwise.train import loop\n",
        "shardwise/config/load.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shardwise.train import loop\n",
        "shardwise/train/__init__.py": "",
        "shardwise/train/loop.py": "from shardwise.config import schema\n",
    })
    graph = import_graph(root.parent / "shardwise")
    ups = [(m, d) for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m)]
    assert ups == [("shardwise.config.schema", "shardwise.train.loop")]
