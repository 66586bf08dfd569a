"""Does --target-clip-frac hold its target? The clip fraction step by step, with and without the controller.

    python benchmarks/clip_controller.py                             # default task and model, GSPO, F = 0.1, 40 steps
    python benchmarks/clip_controller.py --target 0.2 --steps 60     # another target, longer
    python benchmarks/clip_controller.py --extra "--algorithm grpo"  # more gspo train flags, for both runs

Two `python -m gspo train --threads 1` runs, the same seed and task: the preset's fixed clip range,
and `--target-clip-frac F` (gspo.algo.clipcontrol: both bounds scaled by exp(0.5 * clamp((f - F)/F,
-1, 1)) after each step). Printed from each run's metrics.jsonl:

- one row per step: the clip fraction of both runs and the controller's range (clip/eps_low,
  clip/eps_high: the range that step used);
- for each run: the mean and standard deviation of clip/frac over the second half of the steps,
  the share of those steps within the band F/2 .. 3F/2, and the first step from which the running
  mean of the last 5 steps stays within it; and the held-out accuracy before -> after.

Exits non-zero if a run fails. The runs stay in --out (default: a fresh temporary folder).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def train(out: Path, steps: int, seed: int, extra: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "gspo", "train", "--steps", str(steps), "--seed", str(seed), "--threads", "1",
           "--no-progress", "--output-dir", str(out), *extra]
    print("$", " ".join(shlex.quote(c) for c in cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def held(fracs: list[float], target: float) -> dict:
    """The second half's mean and spread, its share within [F/2, 3F/2], and the first step from which
    the mean of the last 5 steps stays in that band."""
    low, high = target / 2, 3 * target / 2
    half = fracs[len(fracs) // 2:]
    means = [statistics.mean(fracs[max(0, i - 4):i + 1]) for i in range(len(fracs))]
    settled = next((i + 1 for i in range(len(means)) if all(low <= m <= high for m in means[i:])), None)
    return {"mean": statistics.mean(half), "sd": statistics.pstdev(half),
            "within": sum(low <= f <= high for f in half) / len(half), "settled": settled}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=float, default=0.1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extra", default="", help="more gspo train flags, for both runs")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="clip-controller-"))
    extra = shlex.split(a.extra)
    fixed = train(out / "fixed", a.steps, a.seed, extra)
    held_rows = train(out / "target", a.steps, a.seed, [*extra, "--target-clip-frac", str(a.target)])
    print(f"\nstep  clip/frac fixed  clip/frac target {a.target:g}  eps_low     eps_high")
    for f, t in zip(fixed, held_rows):
        print(f"{f['step']:>4}  {f['clip/frac']:>15.3f}  {t['clip/frac']:>16.3f}  {t['clip/eps_low']:<10.4g}  "
              f"{t['clip/eps_high']:.4g}")
    print(f"\nband {a.target / 2:g} .. {3 * a.target / 2:g}; second half = steps {a.steps // 2 + 1}..{a.steps}")
    for name, rows in (("fixed", fixed), ("target", held_rows)):
        h = held([r["clip/frac"] for r in rows], a.target)
        summary = json.loads((out / name / "summary.json").read_text())
        before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
        print(f"{name:>6}: clip/frac {h['mean']:.3f} ± {h['sd']:.3f} (second half), {100 * h['within']:.0f}% of those "
              f"steps in the band, settled from step {h['settled'] or '-'}; held-out accuracy {100 * before:.1f}% -> "
              f"{100 * after:.1f}%")
    print(f"runs: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
