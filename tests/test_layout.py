"""The shape of the package, held: no import circle, at most 12 floors of imports, no module over
400 lines, no function over 60 lines or over 6 parameters (outside the public API), config a leaf.

Imports are read from the source (ast), at module level and inside functions alike: an import
inside a function is still an arrow, and a circle hidden that way is still a circle. A floor is
a module's height in the import graph: a module importing nothing of gspo stands on floor 1,
one that imports it on floor 2, and so on.
"""

from __future__ import annotations

import ast
import sys
from functools import cache
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gspo"
# public entry points whose parameters mirror a user-facing API (TRL's GRPOTrainer; the loss's tensors)
PUBLIC = {"api.py:Trainer.__init__", "losses.py:policy_loss"}


def modules() -> dict[str, Path]:
    """'gspo.trainer' -> its path (the package face gspo/__init__.py left out: it only re-exports)."""
    return {"gspo." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent != PACKAGE}


def room(module: str) -> str:
    """A module's room in the house: a top-level module, or its sub-package as a whole ('gspo.tasks.chain' ->
    'gspo.tasks'): what a package's modules import of each other is its own affair."""
    return ".".join(module.split(".")[:2])


@cache
def imports() -> dict[str, set[str]]:
    """Room (a top-level module or a sub-package) -> the rooms it imports, anywhere in its source."""
    known = modules()
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}  # from gspo import checkpoint
        out.setdefault(room(name), set()).update(room(d) for d in deps if d in known and room(d) != room(name))
    return out


def floors() -> dict[str, int]:
    graph, height = imports(), {}

    def floor(m: str, path: tuple = ()) -> int:
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + (m,))}"
        if m not in height:
            height[m] = 1 + max((floor(d, path + (m,)) for d in graph[m]), default=0)
        return height[m]

    for m in graph:
        floor(m)
    return height


def test_no_import_circle_and_at_most_12_floors():
    height = floors()  # raises on a circle, naming it
    top = max(height.values())
    assert top <= 12, sorted(height.items(), key=lambda kv: -kv[1])[:5]


def test_config_and_metrics_are_leaves():
    graph = imports()
    assert graph["gspo.config"] == set()  # the package: TrainConfig and its sections
    assert graph["gspo.metrics"] == set()


def test_module_and_function_sizes():
    too_long, too_many, big = [], [], []
    for name, path in modules().items():
        text = path.read_text()
        if len(text.splitlines()) > 400:
            big.append(f"{path.name}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                for fn in node.body:
                    fn.parent_class = node.name  # so methods are named Class.method
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            owner = getattr(node, "parent_class", None)
            where = f"{path.relative_to(PACKAGE)}:{owner + '.' if owner else ''}{node.name}"
            lines = node.end_lineno - node.lineno + 1
            a = node.args
            params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
            if lines > 60:
                too_long.append(f"{where} ({lines} lines)")
            if count > 6 and where not in PUBLIC:
                too_many.append(f"{where} ({count} parameters)")
    assert not big, big
    assert not too_long, too_long
    assert not too_many, too_many


def test_the_checker_sees_a_circle_and_a_function_level_import(tmp_path, monkeypatch):
    # the checks above can fail: a circle through an import inside a function is found
    pkg = tmp_path / "gspo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from gspo.b import f\n")
    (pkg / "b.py").write_text("def f():\n    from gspo import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    imports.cache_clear()
    try:
        assert imports() == {"gspo.a": {"gspo.b"}, "gspo.b": {"gspo.a"}}
        try:
            floors()
        except AssertionError as e:
            assert "import circle: gspo.a -> gspo.b -> gspo.a" in str(e)
        else:
            raise AssertionError("the circle was not found")
    finally:
        imports.cache_clear()
