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
import re
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
         "gspo.sampling", "gspo.agents", "gspo.train", "gspo.lab", "gspo.commands", "gspo.export", "gspo.api",
         "gspo.cli", "gspo.__main__"]
# public entry points whose parameters mirror a user-facing API (TRL's GRPOTrainer; the loss's tensors)
PUBLIC = {"api.py:Trainer.__init__", "algo/losses.py:policy_loss"}
MAX_LINES, MAX_PARAMS = 60, 6  # a function's limits (CONTRIBUTING.md says them: tests/test_docs.py)


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
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(tree):
            if runtime and id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                # from ..train import run: gspo.train, from the package the module is in
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1]) if node.level else ""
                module = ".".join(p for p in (base, node.module or "") if p)
                deps.add(module)
                deps |= {f"{module}.{a.name}" for a in node.names}  # from gspo.train import checkpoint
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
    # every arrow counts, an annotation's import under `if TYPE_CHECKING:` too: a circle that only a
    # type checker follows is still a circle in the design (gspo.train's modules read the run through
    # the small protocols they declare, not gspo.train.run.Run). A room's face (its __init__) may name
    # its own members (gspo.config's TrainConfig.from_trl reads gspo.config.trl when called): that
    # arrow is the room presenting itself, not a circle
    graph = {m: {d for d in deps if not d.startswith(m + ".")} for m, deps in module_imports().items()}
    floors(graph)  # raises on a circle, naming it


def allowed(room: str) -> set[str]:
    """The rooms `room`'s docstring says it may import: the rooms its "May import" sentence lists
    (names, separated by commas and "and"; reasons in parentheses, nested ones too, left out), every
    room below it for "everything below", none for "imports nothing". Anything else in the list
    (a word, a room that does not exist) fails: the contract is what it lists, not what prose names."""
    init = PACKAGE / room.removeprefix("gspo.") / "__init__.py"
    doc = " ".join((ast.get_docstring(ast.parse(init.read_text())) or "").split())
    if "imports nothing" in doc and "May import" not in doc:
        return set()
    text, sentence, depth = doc[doc.index("May import") + len("May import"):], "", 0
    for i, ch in enumerate(text):  # up to the period that ends the sentence, parentheses left out
        if ch in "()":
            depth += 1 if ch == "(" else -1
        elif depth == 0:
            if ch == "." and text[i + 1:i + 2] in ("", " "):
                break
            sentence += ch
    below = re.search(r"\beverything below (it|them)\b", sentence) is not None
    items = [i.strip() for i in re.split(r",|:|\band\b", re.sub(r"\beverything below (it|them)\b", "", sentence))]
    items = [i for i in items if i]
    bad = [i for i in items if not re.fullmatch(r"[A-Za-z_]\w*(\.\w+)*", i)  # a word, not a name
           or (i.startswith("gspo.") and i not in ORDER)]  # no such room
    assert depth == 0 and not bad, f'{room}: its "May import" list holds {bad or ["an unmatched parenthesis"]}: ' \
        "list rooms, separated by commas and 'and', with reasons in parentheses"
    named = {i for i in items if i.startswith("gspo.")}
    if below:
        top = max((ORDER.index(n) for n in named), default=ORDER.index(room) - 1)
        named |= set(ORDER[:top + 1])
    return named - {room}


def test_every_room_imports_only_what_its_docstring_allows():
    rooms = [r for r in ORDER if (PACKAGE / r.removeprefix("gspo.") / "__init__.py").exists()]
    graph = imports()
    broken = [f"{r} imports {d}, outside its list {sorted(allowed(r))}" for r in rooms
              for d in sorted(graph.get(r, ())) if d not in allowed(r)]
    assert not broken, broken


def test_the_training_room_reads_episodes_not_agents():
    # an agent's later sequences are the Episodes' own (gspo.sampling.episodes: `more`): preparing a
    # batch, its advantages and its log-probs know episodes, never agents
    assert not {d for d in module_imports()["gspo.train.batch"] if d.startswith("gspo.agents")}


def test_the_contract_reader_reads_each_form():
    assert allowed("gspo.io") == set()  # "imports nothing of gspo"
    assert allowed("gspo.tasks") == {"gspo.config", "gspo.io"}
    assert allowed("gspo.rewards") == {"gspo.tasks", "gspo.models", "gspo.config", "gspo.io"}  # reasons skipped
    assert allowed("gspo.lab") == set(ORDER[:ORDER.index("gspo.train") + 1])  # "gspo.train and everything below it"
    assert "gspo.lab" not in allowed("gspo.train") and "gspo.agents" in allowed("gspo.train")
    assert "gspo.train" not in allowed("gspo.agents") and "gspo.sampling" in allowed("gspo.agents")


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
            if lines > MAX_LINES:
                too_long.append(f"{where} ({lines} lines)")
            if count > MAX_PARAMS and where not in PUBLIC:
                too_many.append(f"{where} ({count} parameters)")
    assert not too_long, too_long
    assert not too_many, too_many


def _fake_package(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """A package `gspo` under tmp_path with `files` (path in it -> source), each room with an empty
    __init__.py, read by the checks here in place of the real one."""
    pkg = tmp_path / "gspo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name, source in files.items():
        (pkg / name).parent.mkdir(exist_ok=True)
        (pkg / name).parent.joinpath("__init__.py").touch()
        (pkg / name).write_text(source)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    module_imports.cache_clear()


def test_the_checker_sees_a_circle_an_arrow_up_and_a_function_level_import(tmp_path, monkeypatch):
    # the checks above can fail: a circle through an import inside a function is found, and an
    # arrow from a lower room to a higher one
    _fake_package(tmp_path, monkeypatch, {"io/a.py": "from gspo.train.b import f\n",
                                          "train/b.py": "def f():\n    from gspo.io import a\n"})
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


def test_an_annotation_import_is_a_circle_and_an_arrow(tmp_path, monkeypatch):
    # `if TYPE_CHECKING:` imports never run, but a type checker follows them: gspo.train.a <-> gspo.train.b
    # through one is a circle here, and from a lower room to a higher one it is an arrow up
    typing_only = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from gspo.train.a import A\n"
    _fake_package(tmp_path, monkeypatch, {"train/a.py": "from gspo.train.b import f\n",
                                          "train/b.py": typing_only + "def f(): pass\n", "io/c.py": typing_only})
    try:
        assert module_imports()["gspo.train.b"] == {"gspo.train.a"}
        assert module_imports(runtime=True)["gspo.train.b"] == set()  # what runs: no arrow
        try:
            test_no_import_circle_between_modules()
        except AssertionError as e:
            assert "import circle: gspo.train.a -> gspo.train.b -> gspo.train.a" in str(e)
        else:
            raise AssertionError("the annotation's circle was not found")
        try:
            test_every_room_imports_only_rooms_below_it()
        except AssertionError as e:
            assert "gspo.io -> gspo.train" in str(e)
        else:
            raise AssertionError("the annotation's arrow back up was not found")
    finally:
        module_imports.cache_clear()


def test_a_relative_import_is_an_arrow(tmp_path, monkeypatch):
    # `from ..train import run` in gspo.agents is the arrow `from gspo.train import run` is
    _fake_package(tmp_path, monkeypatch, {"agents/side.py": "from ..train import run\nfrom . import other\n",
                                          "agents/other.py": "from ..train.run import Run\n", "train/run.py": ""})
    try:
        got = module_imports()
    finally:
        module_imports.cache_clear()
    assert got["gspo.agents.side"] == {"gspo.train", "gspo.train.run", "gspo.agents", "gspo.agents.other"}
    assert got["gspo.agents.other"] == {"gspo.train.run"}


def _contract(tmp_path, monkeypatch, doc: str) -> set[str]:
    """What `allowed` reads in a gspo.rewards whose docstring is `doc`."""
    (tmp_path / "gspo" / "rewards").mkdir(parents=True, exist_ok=True)
    (tmp_path / "gspo" / "rewards" / "__init__.py").write_text(f'"""{doc}"""\n')
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", tmp_path / "gspo")
    return allowed("gspo.rewards")


def test_the_contract_reader_allows_only_the_rooms_listed(tmp_path, monkeypatch):
    # a reason is said in parentheses (nested ones too, periods inside them too); a room named in
    # prose outside them would widen the contract without anyone listing it: the list is refused
    assert _contract(tmp_path, monkeypatch, "Scores. May import: gspo.tasks (as (gspo.train) does. Not gspo.lab), "
                                            "gspo.io. Later gspo.api.") == {"gspo.tasks", "gspo.io"}
    for prose in ("May import: gspo.tasks, as gspo.train does.", "May import: gspo.tasks (see gspo.lab.",
                  "May import: gspo.tasks, gspo.sampler."):
        try:
            got = _contract(tmp_path, monkeypatch, prose)
        except AssertionError as e:
            assert "gspo.rewards: its \"May import\" list" in str(e), e
        else:
            raise AssertionError(f"{prose!r} read as {sorted(got)}")


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
