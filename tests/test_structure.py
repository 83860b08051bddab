"""The package's shape, checked from its source: no import circle, no module importing from
a layer above its own, models/llama.py a readable size.

The graph is read with ``ast`` (nothing is imported): an edge for every ``import`` and
``from ... import`` anywhere in a module (function-local imports included: a deferred
import is still a dependency), to the module it names; ``from package import name`` points
at the submodule ``package.name`` when there is one, else at the package. Imports under
``if TYPE_CHECKING:`` are left out: they never run, and name a type for an annotation only. Importing a submodule is not counted as importing its parent packages (the
parents' ``__init__`` run, but a package that re-exports its submodules would otherwise
make every import inside it a circle).
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "verispec"

# Bottom to top: a module may import from its own layer and the layers below it, never
# from one above. Patterns are fnmatch patterns on dotted module names; every module of
# the package must match exactly one layer (a new module gets a place here).
LAYERS: list[tuple[str, list[str]]] = [
    ("core", ["verispec", "verispec._args", "verispec._policy", "verispec.reference",
              "verispec.reference_allocator", "verispec.cache"]),
    ("model protocol", ["verispec.models.base", "verispec.models.staging",
                        "verispec.models.tokenizer"]),
    ("layers", ["verispec.models.layers", "verispec.models.layers.*"]),
    ("ops", ["verispec.ops"]),
    ("models", ["verispec.models.llama", "verispec.models.llama_tp", "verispec.models.hf",
                "verispec.models.hf.*"]),
    ("loaders", ["verispec.models.gguf_file", "verispec.models.hf_folder",
                 "verispec.models.loaders",
                 "verispec.models.testing", "verispec.models"]),
    ("drafters", ["verispec.drafters", "verispec.drafters.*"]),
    ("decoder", ["verispec.decoder", "verispec.distributed"]),
    ("training", ["verispec.training", "verispec.training.*"]),
    ("applications", ["verispec.benchmark", "verispec.lab", "verispec.server",
                      "verispec.server.*", "verispec.cli", "verispec.cli.*",
                      "verispec.__main__"]),
]

# Pairs of one layer that must not see each other either: the HF adapter and the native
# Llama stand side by side on the layers; what both need lives in models/layers.
APART = [(["verispec.models.hf", "verispec.models.hf.*"],
          ["verispec.models.llama", "verispec.models.llama_tp"])]

LLAMA_MAX_LINES = 800


# --- the graph ------------------------------------------------------------------------------

def module_name(path: Path, root: Path) -> tuple[str, bool]:
    """(dotted name, is a package) of the module at ``path`` under ``root`` (the folder
    holding the top package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def imports_of(source: str, name: str, is_package: bool, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that the module ``name``'s ``source`` imports."""
    found = set()
    package = name if is_package else name.rpartition(".")[0]

    def add(target: str, names: list[str]) -> None:
        subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
        found.update(subs)
        if len(subs) < len(names) or not names:
            # the rest are names defined by `target` itself (or a module outside the set)
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.add(target)

    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, [])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            add(target, [a.name for a in node.names if a.name != "*"])
    found.discard(name)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` but those in the body of an ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))


def package_graph(root: Path = PACKAGE.parent, top: str = "verispec") -> dict[str, set[str]]:
    """module -> the package modules it imports, for every .py under ``root / top``."""
    paths = sorted((root / top).rglob("*.py"))
    names = {p: module_name(p, root) for p in paths}
    modules = {n for n, _ in names.values()}
    return {n: imports_of(p.read_text(), n, pkg, modules) for p, (n, pkg) in names.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle of ``graph`` as [a, b, ..., a], or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node, [])
            if cycle:
                return cycle
    return []


def layer_of(module: str, layers=LAYERS) -> list[int]:
    """The indices of the layers whose patterns match ``module``."""
    return [i for i, (_, patterns) in enumerate(layers)
            if any(fnmatch.fnmatchcase(module, p) for p in patterns)]


def unplaced(graph: dict[str, set[str]], layers=LAYERS) -> list[str]:
    """Modules that match no layer or more than one."""
    return sorted(m for m in graph if len(layer_of(m, layers)) != 1)


def _matches(module: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def upward_arrows(graph: dict[str, set[str]], layers=LAYERS, apart=APART) -> list[str]:
    """Every import from a module to one in a higher layer, or between a pair kept apart,
    as "a (layer) -> b (layer)"."""
    bad = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            la, lb = layer_of(a, layers), layer_of(b, layers)
            if len(la) != 1 or len(lb) != 1:
                continue  # unplaced() reports it
            upward = lb[0] > la[0]
            sideways = any(_matches(a, xs) and _matches(b, ys) or _matches(a, ys) and _matches(b, xs)
                           for xs, ys in apart)
            if upward or sideways:
                bad.append(f"{a} ({layers[la[0]][0]}) -> {b} ({layers[lb[0]][0]})")
    return bad


GRAPH = package_graph()


# --- the rules on the package ---------------------------------------------------------------

def test_the_graph_sees_the_package():
    assert len(GRAPH) > 50
    assert "verispec.models.layers.kernels" in GRAPH["verispec.models.llama"]
    # a function-local import counts (models/base.py imports staging inside a method)
    assert "verispec.models.staging" in GRAPH["verispec.models.base"]


def test_no_import_circle():
    assert find_cycle(GRAPH) == []


def test_every_module_has_a_layer():
    assert unplaced(GRAPH) == []


def test_no_module_imports_from_a_layer_above_it():
    assert upward_arrows(GRAPH) == []


def too_long(path: Path, limit: int) -> str:
    """"path: N lines (limit L)" when ``path`` has ``limit`` lines or more, else ""."""
    lines = len(path.read_text().splitlines())
    return f"{path.name}: {lines} lines (limit {limit})" if lines >= limit else ""


def test_llama_stays_readable():
    assert too_long(PACKAGE / "models" / "llama.py", LLAMA_MAX_LINES) == ""


# --- the checkers can fail ------------------------------------------------------------------

def write_package(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return package_graph(tmp_path, "pkg")


def test_the_graph_reads_every_kind_of_import(tmp_path):
    graph = write_package(tmp_path, {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "from pkg import c, VALUE\n",                  # a submodule and a name
        "c.py": "def f():\n    from .sub import d\n",        # local and relative
        "sub/__init__.py": "from . import d\n",
        "sub/d.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                     "    from pkg.c import T\nelse:\n    from ..a import x\n"),
    })
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg", "pkg.c"},
                     "pkg.c": {"pkg.sub.d"}, "pkg.sub": {"pkg.sub.d"}, "pkg.sub.d": {"pkg.a"}}
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.sub.d", "pkg.a"]


def test_find_cycle_reports_a_circle_and_only_one():
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": set()}) == []
    assert find_cycle({"x": {"y"}, "y": {"z"}, "z": {"y"}}) == ["y", "z", "y"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
    # the circle this package had: batch_invariant imported rms_norm back from llama
    before = {"verispec.models.llama": {"verispec.models.batch_invariant"},
              "verispec.models.batch_invariant": {"verispec.models.llama"}}
    assert len(find_cycle(before)) == 3


def test_upward_arrows_reports_an_arrow_up_and_a_sideways_borrow():
    layers = [("low", ["p.low*"]), ("mid", ["p.mid", "p.side"]), ("top", ["p.top"])]
    apart = [(["p.side"], ["p.mid"])]
    assert upward_arrows({"p.top": {"p.mid", "p.low"}, "p.mid": {"p.low"}, "p.low": set()},
                         layers, apart) == []
    assert upward_arrows({"p.low": {"p.mid"}, "p.mid": set()}, layers, apart) == [
        "p.low (low) -> p.mid (mid)"]
    assert upward_arrows({"p.side": {"p.mid"}, "p.mid": set()}, layers, apart) == [
        "p.side (mid) -> p.mid (mid)"]
    # what hf_patch.py did before models/layers/linear.py: borrow matmul_layout from llama
    assert upward_arrows({"verispec.models.hf.patch": {"verispec.models.llama"},
                          "verispec.models.llama": set()}) == [
        "verispec.models.hf.patch (models) -> verispec.models.llama (models)"]
    assert upward_arrows({"verispec.models.layers.batch_invariant": {"verispec.models.llama"},
                          "verispec.models.llama": set()}) == [
        "verispec.models.layers.batch_invariant (layers) -> verispec.models.llama (models)"]


def test_unplaced_reports_a_module_without_a_layer():
    assert unplaced({"verispec.models.layers.kernels": set(), "verispec.newthing": set()}) == [
        "verispec.newthing"]


@pytest.mark.parametrize("lines", [LLAMA_MAX_LINES - 1, LLAMA_MAX_LINES, 1002])
def test_the_size_rule_counts_lines(tmp_path, lines):
    path = tmp_path / "llama.py"
    path.write_text("x = 1\n" * lines)
    want = "" if lines < LLAMA_MAX_LINES else f"llama.py: {lines} lines (limit {LLAMA_MAX_LINES})"
    assert too_long(path, LLAMA_MAX_LINES) == want
