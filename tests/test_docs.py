"""The docs (README.md and docs/*.md) document what the code does: every option, every metric name."""

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
