"""Held-out accuracy against steps and against training wall time for the configurations of a
`gspo compare` directory (docs/distill.md's table and plot): the mean over seeds at each evaluation,
and the first step (and seconds) at which each configuration's mean comes within `--within` points
of a target accuracy (the teacher's).

    python benchmarks/distill_curves.py runs/compare-distill --target 83.4 --out docs/compare-distill/curves.png

Wall time is the runs' own training time up to each evaluation: the sum of `time/step_seconds`
over the steps before it (evaluations left out), averaged over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from common import ROOT  # noqa: F401  (puts the repository on sys.path)

from gspo.lab.plot import _pyplot, _save


def curves(out: Path) -> dict[str, list[tuple[int, float, float]]]:
    """configuration -> [(step, mean accuracy %, mean training seconds to that step)] over its seeds."""
    by = defaultdict(lambda: defaultdict(list))  # name -> step -> [(accuracy, seconds)]
    for run in sorted((out / "runs").iterdir()):
        if not (run / "summary.json").exists():
            continue
        name = run.name.rsplit("-seed", 1)[0]
        seconds, clock = {0: 0.0}, 0.0
        for line in (run / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            clock += row.get("time/step_seconds", 0.0)
            seconds[row["step"]] = clock
        for e in json.loads((run / "summary.json").read_text())["evals"]:
            by[name][e["step"]].append((100 * e["accuracy"], seconds.get(e["step"], clock)))
    return {name: [(s, statistics.fmean(a for a, _ in v), statistics.fmean(t for _, t in v))
                   for s, v in sorted(steps.items())] for name, steps in by.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("compare_dir", type=Path)
    ap.add_argument("--target", type=float, required=True, help="the teacher's accuracy, in %%")
    ap.add_argument("--within", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=None, help="a PNG of both plots")
    args = ap.parse_args()
    data = curves(args.compare_dir)
    steps = sorted({s for c in data.values() for s, _, _ in c})
    print("| configuration | " + " | ".join(f"step {s}" for s in steps) + f" | within {args.within:g} of "
          f"{args.target:g}% at |")
    print("| --- " * (len(steps) + 2) + "|")
    for name, c in data.items():
        at = dict((s, a) for s, a, _ in c)
        hit = next(((s, t) for s, a, t in c if a >= args.target - args.within), None)
        where = f"step {hit[0]} ({hit[1]:.0f} s)" if hit else "not reached"
        print(f"| {name} | " + " | ".join(f"{at[s]:.1f}" if s in at else "" for s in steps) + f" | {where} |")
    if args.out:
        plt = _pyplot()
        fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
        for name, c in data.items():
            a.plot([s for s, _, _ in c], [x for _, x, _ in c], marker="o", label=name)
            b.plot([t for _, _, t in c], [x for _, x, _ in c], marker="o", label=name)
        for ax, xlabel in ((a, "step"), (b, "training seconds (evaluations left out)")):
            ax.axhline(args.target, color="grey", ls="--", lw=1)
            ax.axhline(args.target - args.within, color="grey", ls=":", lw=1)
            ax.set_xlabel(xlabel)
            ax.grid(alpha=0.3)
        a.set_ylabel("held-out greedy accuracy, % (mean over seeds)")
        a.legend(fontsize=8)
        fig.tight_layout()
        print(f"plot: {_save(fig, args.out)}")


if __name__ == "__main__":
    main()
