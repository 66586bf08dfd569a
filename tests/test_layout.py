"""The shape of the package, held: rooms (sub-packages by role) stacked in one order, each importing
only rooms below it; no import circle between modules; no function over 60 lines or over 6
parameters (outside the public API). A module is as long as its concept needs.

Imports are read from the source (ast), at module level and inside functions alike: an import
inside a function is still an arrow, and a circle hidden that way is still a circle. The rooms,
from the ground up (CONTRIBUTING.md, "Where things go"): a room may import the rooms before it.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gspo"
# the rooms from the ground floor up; the user's entry points (cli, api, export, __main__) stand on top
ORDER = ["gspo.io", "gspo.algo", "gspo.config", "gspo.tasks", "gspo.models", "gspo.processes", "gspo.rewards",
         "gspo.sampling", "gspo.train", "gspo.lab", "gspo.commands", "gspo.export", "gspo.api", "gspo.cli",
         "gspo.__main__"]
# public entry points whose parameters mirror a user-facing API (TRL's GRPOTrainer; the loss's tensors)
PUBLIC = {"api.py:Trainer.__init__", "algo/losses.py:policy_loss"}


def modules() -> dict[str, Path]:
    """'gspo.train.trainer' -> its path (the package face gspo/__init__.py left out: it only re-exports)."""
    return {"gspo." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__init__.py" or p.parent != PACKAGE}


def room(module: str) -> str:
    """A module's room: its sub-package ('gspo.train.trainer' -> 'gspo.train'), or a top-level module."""
    return ".".join(module.split(".")[:2])


@cache
def module_imports(runtime: bool = False) -> dict[str, set[str]]:
    """Module -> the gspo modules it imports, anywhere in its source; `runtime`: less those under
    `if TYPE_CHECKING:` (read by type checkers only, never run)."""
    known = modules()
    out: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                       for n in ast.walk(block)}
        deps = set()
        for node in ast.walk(tree):
            if runtime and id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names}  # from gspo.train import checkpoint
        out[name] = {d for d in deps if d in known and d != name}
    return out


def imports() -> dict[str, set[str]]:
    """Room -> the other rooms it imports."""
    out: dict[str, set[str]] = {}
    for m, deps in module_imports().items():
        out.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
    return out


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's height: 1 + the highest it imports; raises on a circle, naming it."""
    height: dict[str, int] = {}

    def floor(m: str, path: tuple = ()) -> int:
        assert m not in path, f"import circle: {' -> '.join(path[path.index(m):] + (m,))}"
        if m not in height:
            height[m] = 1 + max((floor(d, path + (m,)) for d in graph.get(m, ())), default=0)
        return height[m]

    for m in graph:
        floor(m)
    return height


def test_every_room_imports_only_rooms_below_it():
    graph = imports()
    assert set(graph) <= set(ORDER), f"rooms not placed in ORDER: {sorted(set(graph) - set(ORDER))}"
    up = [f"{r} -> {d}" for r, deps in graph.items() for d in deps if ORDER.index(d) > ORDER.index(r)]
    assert not up, f"arrows back up: {up}"


def test_no_import_circle_between_modules():
    # what runs: an annotation's import under `if TYPE_CHECKING:` (gspo.train.critic's `run: Run`)
    # is no arrow here (the room order above still counts it), and a room's face (its __init__)
    # may name its own members (gspo.config's TrainConfig.from_trl reads gspo.config.trl when
    # called): that arrow is the room presenting itself, not a circle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in module_imports(runtime=True).items()}
    floors(graph)  # raises on a circle, naming it


def test_every_room_says_what_lives_there_and_what_it_may_import():
    for r in ORDER:
        init = PACKAGE / r.removeprefix("gspo.") / "__init__.py"
        if init.parent.is_dir():
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            assert doc and ("May import" in doc or "imports nothing" in doc), f"{init}: no docstring saying its imports"


def test_config_sections_and_algo_import_no_configuration():
    deps = module_imports()
    assert deps["gspo.config"] <= {"gspo.config.sections", "gspo.config.trl"} and deps["gspo.config.sections"] == set()
    assert not [m for m in deps if m.startswith("gspo.algo.") and any(d.startswith("gspo.config") for d in deps[m])]


def test_function_sizes():
    too_long, too_many = [], []
    for _name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for fn in node.body:
                    fn.parent_class = node.name  # so methods are named Class.method
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            owner = getattr(node, "parent_class", None)
            where = f"{path.relative_to(PACKAGE).as_posix()}:{owner + '.' if owner else ''}{node.name}"
            lines = node.end_lineno - node.lineno + 1
            a = node.args
            params = [x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            count = len(params) + (a.vararg is not None) + (a.kwarg is not None)
            if lines > 60:
                too_long.append(f"{where} ({lines} lines)")
            if count > 6 and where not in PUBLIC:
                too_many.append(f"{where} ({count} parameters)")
    assert not too_long, too_long
    assert not too_many, too_many


def test_the_checker_sees_a_circle_an_arrow_up_and_a_function_level_import(tmp_path, monkeypatch):
    # the checks above can fail: a circle through an import inside a function is found, and an
    # arrow from a lower room to a higher one
    pkg = tmp_path / "gspo"
    (pkg / "io").mkdir(parents=True)
    (pkg / "train").mkdir()
    for init in (pkg / "__init__.py", pkg / "io" / "__init__.py", pkg / "train" / "__init__.py"):
        init.write_text("")
    (pkg / "io" / "a.py").write_text("from gspo.train.b import f\n")
    (pkg / "train" / "b.py").write_text("def f():\n    from gspo.io import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    module_imports.cache_clear()
    try:
        assert module_imports() == {"gspo.io": set(), "gspo.io.a": {"gspo.train.b"}, "gspo.train": set(),
                                    "gspo.train.b": {"gspo.io", "gspo.io.a"}}
        try:
            floors(module_imports())
        except AssertionError as e:
            assert "import circle: gspo.io.a -> gspo.train.b -> gspo.io.a" in str(e)
        else:
            raise AssertionError("the circle was not found")
        try:
            test_every_room_imports_only_rooms_below_it()
        except AssertionError as e:
            assert "gspo.io -> gspo.train" in str(e)
        else:
            raise AssertionError("the arrow back up was not found")
    finally:
        module_imports.cache_clear()


def test_an_annotation_import_is_no_circle_but_still_an_arrow(tmp_path, monkeypatch):
    # `if TYPE_CHECKING:` imports never run: gspo.train.a <-> gspo.train.b through one is no
    # circle at run time; from a lower room to a higher one it is still an arrow up
    pkg = tmp_path / "gspo"
    for room in ("io", "train"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "a.py").write_text("from gspo.train.b import f\n")
    (pkg / "train" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from gspo.train.a import A\ndef f(): pass\n")
    (pkg / "io" / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from gspo.train.a import A\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    module_imports.cache_clear()
    try:
        assert module_imports()["gspo.train.b"] == {"gspo.train.a"}
        assert module_imports(runtime=True)["gspo.train.b"] == set()
        test_no_import_circle_between_modules()  # no circle at run time
        try:
            test_every_room_imports_only_rooms_below_it()
        except AssertionError as e:
            assert "gspo.io -> gspo.train" in str(e)
        else:
            raise AssertionError("the annotation's arrow back up was not found")
    finally:
        module_imports.cache_clear()


@pytest.mark.slow  # starts a process
def test_ruff_lints_every_module():
    # ruff's default `exclude` skips any folder named dist, build, venv ...: a room called so went
    # unlinted (gspo/dist, 971 lines, until 0.4.0). pyproject.toml names its exclusions instead.
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed (scripts/setup.sh installs it)"
    shown = subprocess.run([ruff, "check", "--show-files", str(PACKAGE)], capture_output=True, text=True,
                           cwd=PACKAGE.parent, check=True).stdout
    seen = {Path(line.strip()).resolve() for line in shown.splitlines() if line.strip().endswith(".py")}
    missing = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py") if p.resolve() not in seen)
    assert not missing, f"ruff skips: {missing}"


@pytest.mark.slow  # starts a process
def test_pytest_collects_every_module_for_its_doctests(tmp_path):
    # pytest's default `norecursedirs` skips any folder named dist or build: gspo/dist's doctests never
    # ran. A plugin records what pytest would collect under gspo/ (--doctest-modules) and collects
    # nothing, so no module is imported here. pytest leaves __main__.py out by design: it has no doctest.
    (tmp_path / "seen_plugin.py").write_text(textwrap.dedent("""
        import os
        import pytest

        @pytest.hookimpl(wrapper=True)
        def pytest_collect_file(file_path, parent):
            got = yield
            with open(os.environ["SEEN_FILE"], "a") as f:
                f.writelines(f"{type(c).__name__} {c.path}\\n" for c in got)
            return []
        """))
    seen_file = tmp_path / "seen.txt"
    env = {**os.environ, "SEEN_FILE": str(seen_file), "PYTHONPATH": str(tmp_path)}
    subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "seen_plugin", "-p",
                    "no:cacheprovider", str(PACKAGE)], cwd=PACKAGE.parent, env=env, capture_output=True, check=False)
    seen = {Path(line.split(" ", 1)[1]).resolve() for line in seen_file.read_text().splitlines()
            if line.startswith("DoctestModule ")}
    main = PACKAGE / "__main__.py"
    assert ">>>" not in main.read_text()
    missing = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                     if p.resolve() not in seen and p != main)
    assert not missing, f"pytest skips: {missing}"
    assert len(seen) >= 80  # the plugin itself ran: every module but __main__.py was recorded
