"""The docs (README.md, CONTRIBUTING.md and docs/*.md) document what the code does: every option, every
metric name, and every number they state about the repository, computed here from its source.

A figure that changes with nearly every commit is not stated at all: the README says how to count the
tests (`pytest --collect-only -q | tail -1`) instead of a count the next test would make wrong.
"""

import ast
import importlib.metadata
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gspo.algo.aggregation import AGG_MODES
from gspo.algo.losses import policy_loss
from gspo.config import Loss

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = (ROOT / "README.md").read_text()
CONTRIBUTING = (ROOT / "CONTRIBUTING.md").read_text()


def page(name: str) -> str:
    return (DOCS / name).read_text()


@pytest.mark.slow  # starts a process
def test_options_table_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "options_table.py")], capture_output=True, text=True,
                         check=True).stdout.strip()
    block = page("options.md").split("<!-- options:start -->")[1].split("<!-- options:end -->")[0].strip()
    assert block == out, "docs/options.md options table is stale: run python scripts/options_table.py --write"


def test_loss_metrics_and_agg_modes_are_documented():
    lp = torch.zeros(1, 2)
    loss = Loss(algorithm="gspo", clip_low=0.1, clip_high=0.1, beta=0.1)
    _, m = policy_loss(lp, lp, torch.ones(1), torch.ones(1, 2), loss, ref_logp=lp)
    metrics, library = page("metrics.md"), page("library.md")
    for name in m:
        assert f"`{name}`" in metrics, f"{name} missing from docs/metrics.md"
    for mode in AGG_MODES:
        assert f"`{mode}`" in library, f"{mode} missing from docs/library.md"


def test_trainer_metrics_are_documented():
    pattern = (r'"((?:reward|completion|mismatch|time|eval|value|clip|ratio|kl|loss|moe|policy|is|opsm|episode|async|'
               r'groups)/[a-z_]+)"')
    names = set()
    for path in sorted((ROOT / "gspo").rglob("*.py")):  # gspo/*.py and gspo/**/*.py
        names |= set(re.findall(pattern, path.read_text()))
    assert len(names) >= 8
    metrics = page("metrics.md")
    missing = sorted(name for name in names if f"`{name}`" not in metrics)
    assert not missing, f"metric names emitted by gspo/ but missing from docs/metrics.md: {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.sub(r"```.*?```", "", text, flags=re.S), re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _relative_links(text: str) -> list[str]:
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # fenced code
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    targets = re.findall(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]  # skip https:, mailto:, ...


def test_relative_links_resolve():
    files = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    assert len(files) > 1
    broken = []
    for md in files:
        links = _relative_links(md.read_text())
        for target in links:
            path, _, anchor = target.partition("#")
            dest = (md.parent / path).resolve() if path else md
            if not dest.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert blocks[1] == "bash scripts/setup.sh && .venv/bin/python -m pytest -n 2"  # both cores (pytest-xdist)
    assert "README.md" in (ROOT / ".ci" / "run").read_text()


# The numbers the docs state: each is the figure its source gives today.
WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}  # a count the prose spells out

def _prose(text: str) -> str:
    """Text with its line breaks and runs of spaces folded to one space and bold marks removed, so that
    a phrase matches however the page wraps it."""
    return re.sub(r"\s+", " ", text.replace("**", ""))


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def _missing(text: str, phrases: list[str]) -> list[str]:
    prose = _prose(text)
    return [p for p in phrases if p not in prose]


def test_the_readme_fits_in_20_kib():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 20 * 1024, f"README.md is {size} bytes, over 20 KiB: move the detail to its docs page"


def test_the_readme_states_no_test_count():
    # the suite grows with nearly every commit: a count here would be wrong by the next one
    counts = re.findall(r"\b\d[\d,]* (?:tests|doctests|passed)\b", _prose(README))
    assert not counts, f"README.md states a test count {counts}: say how to count them instead"
    assert "pytest --collect-only -q" in README


def test_the_tour_is_a_table_with_a_docs_page_on_every_line():
    rows = [line for line in _section(README, "## A tour").splitlines() if line.startswith("| **")]
    assert len(rows) > 1
    linked, broken = set(), []
    for row in rows:
        links = re.findall(r"\]\(docs/([\w-]+\.md)(?:#([\w-]+))?\)", row)
        if not links:
            broken.append(f"no docs page: {row}")
        for name, anchor in links:
            linked.add(name)
            if not (DOCS / name).exists():
                broken.append(f"docs/{name}: no such file")
            elif anchor and anchor not in _anchors(page(name)):
                broken.append(f"docs/{name}#{anchor}: no such heading")
    assert not broken, "\n".join(broken)
    unlinked = sorted({p.name for p in DOCS.glob("*.md")} - linked - {"tour.md"})  # tour.md: above the table
    assert not unlinked, f"docs pages no line of the README's tour links: {unlinked}"
    assert "(docs/tour.md)" in _section(README, "## A tour")


def test_the_matrix_figures_are_the_arrays():
    from tests import test_matrix as m

    levels = [len(v) for v in m.FACTORS.values()]  # (3, 3, 2, ...) in the factors' order
    two = sum(c["layout"] != "1" for c in m.CELLS)
    one, product, pairs = len(m.CELLS) - two, math.prod(levels), len(m.required_pairs())
    levels_text = "·".join(map(str, levels))
    assert not _missing(page("matrix.md"), [
        f"The full product is {levels_text} = {product:,} runs.",
        f"in {len(m.CELLS)} cells ({one} in one process, {two} under torchrun), covering {pairs} pairs.",
    ]), "docs/matrix.md states the array's size: python tests/test_matrix.py prints it"
    assert not _missing(m.__doc__, [f"{levels_text} = {product:,} runs",
                                    f"has {len(m.CELLS)}: {one} run in this process, {two} under torchrun"])
    # the factors table: one row per factor, in FACTORS' order, with its levels
    factors = _section(page("matrix.md"), "## Factors and levels")
    table = re.findall(r"^\| (?!factor|---)[^|]+\| (.+?) \| .* \|$", factors, re.M)
    assert [len(row.split(", ")) for row in table] == levels, "docs/matrix.md's factors table: FACTORS' levels"
    assert table[list(m.FACTORS).index("algorithm")].split(", ") == m.FACTORS["algorithm"]


def test_the_vllm_sub_matrix_is_the_size_the_page_says():
    source = (ROOT / "tests" / "test_vllm.py").read_text()  # read, not imported: it needs vLLM
    cells = next(ast.literal_eval(node.value) for node in ast.parse(source).body
                 if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "VLLM_CELLS")
    factors = [sorted(set(levels)) for levels in zip(*cells)]
    assert {len(f) for f in factors} == {2}  # two-level factors
    assert not _missing(page("matrix.md"), [f"every pair in {len(cells)} one-step runs (the orthogonal array "
                                            f"of {WORDS[len(factors)]} two-level factors)"])


def test_the_rooms_are_listed_as_they_are():
    from tests.test_layout import ORDER

    package = ROOT / "gspo"
    rooms = [r.removeprefix("gspo.") for r in ORDER if (package / r.removeprefix("gspo.") / "__init__.py").exists()]
    assert sorted(rooms) == sorted(p.parent.name for p in package.glob("*/__init__.py"))  # every sub-package placed
    block = re.search(r"^```\ngspo/\n(.*?)^```", README, re.S | re.M)[1]
    assert re.findall(r"^  (\w+)/ ", block, re.M) == rooms, "README.md's Layout: the rooms, from the ground floor up"
    entry_points = {p.name for p in package.glob("*.py")} - {"__init__.py", "__main__.py"}
    assert set(re.findall(r"^  (\w+\.py) ", block, re.M)) == entry_points
    listed = re.findall(r"^\d+\. \*\*`gspo/(\w+)`\*\*", CONTRIBUTING, re.M)
    assert listed == rooms, "CONTRIBUTING.md's Where things go: the rooms, from the ground floor up"


def test_every_module_opens_with_a_docstring():
    # the README says so, in place of a promise about how long the library takes to read
    assert "Every module of `gspo/` opens with a docstring that says what it is for" in _prose(README)
    missing = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "gspo").rglob("*.py"))
               if not ast.get_docstring(ast.parse(p.read_text()))]
    assert not missing, f"modules with no docstring: {missing}"


def test_contributing_lists_the_modules_no_test_file_names():
    tests = "".join(p.read_text() for p in sorted((ROOT / "tests").glob("*.py")))
    modules = [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in sorted((ROOT / "gspo").rglob("*.py"))
               if p.name not in ("__init__.py", "__main__.py")]
    unnamed = {m for m in modules if m not in tests}  # what `grep -l MODULE tests/` finds no file for
    text = _prose(CONTRIBUTING).split("tested only through the modules that use them")[1].split("; grep")[0]
    assert set(re.findall(r"`(gspo\.[\w.]+)`", text)) == unnamed, f"no test file names {sorted(unnamed)}"


def test_contributing_states_the_limits_the_layout_test_holds():
    from tests.test_layout import MAX_LINES, MAX_PARAMS

    assert not _missing(CONTRIBUTING, [f"No function over {MAX_LINES} lines or over {MAX_PARAMS} parameters"])


def test_the_recipes_page_names_every_recipe():
    recipes = sorted(p.name for p in (ROOT / "examples" / "recipes").glob("*.yaml"))
    assert recipes
    assert [r for r in recipes if f"examples/recipes/{r}" not in page("recipes.md")] == []


def test_the_reasoning_gym_count_is_its_versions():
    stated = re.search(r"\((\d+) in reasoning-gym (\d[\w.]*);", _prose(page("real.md")))
    assert stated, "docs/real.md: the generator count with the reasoning-gym version it counts"
    try:
        version = importlib.metadata.version("reasoning-gym")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("reasoning-gym is not installed")
    if version != stated[2]:
        pytest.skip(f"reasoning-gym {version} is installed; docs/real.md counts {stated[2]}'s")
    from gspo.tasks.gym import names

    assert len(names()) == int(stated[1])


def test_the_presets_are_the_size_the_docs_say():
    from gspo.cli import COMPARE_SEEDS
    from gspo.lab.compare import COMPARE_PRESETS
    from gspo.lab.studies import PRECISION, STALENESS, TASKS

    seeds, lags, tasks = len(COMPARE_SEEDS), ", ".join(map(str, STALENESS.levels)), len(TASKS.levels)
    stale, precision = len(COMPARE_PRESETS["staleness"].configs), len(COMPARE_PRESETS["precision"].configs)
    expected = {
        "staleness.md": [f"--preset staleness # {stale} configurations x K = {lags} x {seeds} seeds"],
        "precision.md": [f"--preset precision # {precision} configurations x {len(PRECISION.levels)} precisions "
                         f"x {seeds} seeds"],
        "objectives.md": [f"# all of them, {seeds} seeds, on {WORDS[tasks]} tasks",
                          f"{seeds} seeds each, on {WORDS[tasks]} tasks"],
        "compare.md": [f"GRPO + Routing Replay on tiny-moe, {seeds} seeds", f"on {tasks} tasks (objectives.md)"],
        "length.md": [f"GSPO-token, {seeds} seeds"],
        "tour.md": [f"K = {lags}, {seeds} seeds"],
    }
    missing = {name: _missing(page(name), phrases) for name, phrases in expected.items()}
    assert not any(missing.values()), missing


def test_the_readme_versions_and_defaults_are_the_sources():
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve

    setup, pyproject = (ROOT / "scripts" / "setup.sh").read_text(), (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'pip install -q "torch==([\d.]+)"', setup)[1]
    for name, text in (("README.md", README), ("CONTRIBUTING.md", CONTRIBUTING)):
        assert set(re.findall(r"torch==([\d.]+)", text)) == {pin}, f"{name}: scripts/setup.sh installs torch {pin}"
    floor = re.search(r'"torch>=([\d.]+)"', pyproject)[1]
    python = re.search(r'requires-python = ">=([\d.]+)"', pyproject)[1]
    assert f"`torch>={floor}`" in README and f"Python ≥ {python}" in README
    # the measured table's settings are the defaults: a changed default asks for the table to be measured again
    c = resolve(TrainConfig())
    assert not _missing(README, [
        f"default settings ({c.steps} steps, {c.prompts_per_step} prompts × {c.group_size} completions, "
        f"{c.num_minibatches} minibatches", f"greedy accuracy on {c.eval_size} test problems"])
    for algorithm, label in (("gspo", "GSPO, ε = "), ("grpo", "--algorithm grpo` (ε = ")):
        c = resolve(TrainConfig(algorithm=algorithm))
        low, high = re.search(re.escape(label) + r"([\d.e-]+) / ([\d.e-]+)", README).groups()
        assert (float(low), float(high)) == (c.clip_low, c.clip_high), algorithm
