"""The README documents what the code does: every option, every metric name."""

import re
import subprocess
import sys
from pathlib import Path

import torch

from gspo.losses import AGG_MODES, policy_loss

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_options_table_is_current():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "options_table.py")], capture_output=True, text=True,
                         check=True).stdout.strip()
    block = README.split("<!-- options:start -->")[1].split("<!-- options:end -->")[0].strip()
    assert block == out, "README options table is stale: run python scripts/options_table.py --write"


def test_loss_metrics_and_agg_modes_are_documented():
    lp = torch.zeros(1, 2)
    _, m = policy_loss("gspo", lp, lp, torch.ones(1), torch.ones(1, 2), clip_low=0.1, clip_high=0.1,
                       ref_logp=lp, beta=0.1)
    for name in m:
        assert f"`{name}`" in README, name
    for mode in AGG_MODES:
        assert f"`{mode}`" in README, mode


def test_trainer_metrics_are_documented():
    src = (ROOT / "gspo" / "trainer.py").read_text()
    names = set(re.findall(r'"((?:reward|completion|mismatch|time|eval|value)/[a-z_]+)"', src))
    assert len(names) >= 8
    table = README.split("## Metrics")[1]
    for name in names:
        assert name in table, name


def test_ci_runs_the_readme_test_command():
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    assert blocks[1] == "bash scripts/setup.sh && .venv/bin/python -m pytest"
    assert "README.md" in (ROOT / ".ci" / "run").read_text()
