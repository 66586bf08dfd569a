"""docs/library.md's worked example of adding a loss, run as it is written there: one file, one
registration, and the rest of gspo (configuration checks, the plan, the summary) reads it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def example() -> str:
    page = (ROOT / "docs" / "library.md").read_text()
    section = page.split("## Adding a loss", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
def test_the_worked_example_registers_a_loss_checks_it_by_hand_and_trains(tmp_path):
    # in a fresh interpreter (a registration lasts for the process): the block's own asserts check
    # the loss against its hand arithmetic (-1.14, half the tokens clipped above) and the summary's
    # algorithm; here, the run it wrote planned, trained and refused nothing
    (tmp_path / "example.py").write_text(example())
    r = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "runs" / "grpo-upper"
    plan = json.loads((run / "summary.json").read_text())["plan"]["objective"]
    assert plan["loss"] == "grpo_upper" and plan["clip"] == [0.0, 0.28] and plan["advantages"] == "group"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    assert all(row["clip/low_frac"] == 0.0 for row in rows)  # it never clips below


@pytest.mark.slow  # starts a process
def test_a_changed_example_fails(tmp_path):
    # the block's hand check can fail: without its upper clip the first token's term is 2.0, not 1.28
    code = example().replace("ratio.clamp(max=1 + loss.clip_high) * adv", "ratio * adv")
    code = code.split("summary = gspo.Trainer")[0]
    (tmp_path / "changed.py").write_text(code)
    r = subprocess.run([sys.executable, "changed.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "AssertionError" in r.stderr
