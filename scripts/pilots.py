"""Re-render every stored comparison under docs/compare-*/ and write gspo/lab/pilots.json from them.

    python scripts/pilots.py                 # re-render (no training) and write the pilots
    python scripts/pilots.py --check         # only say whether pilots.json matches the stored studies

Each stored comparison's report.md, compare.json and (for a study) study.md are written again by
gspo.lab.report.rerender: its figures aggregated from the seeds' own, its differences judged, its
minimum detectable differences stated (gspo.lab.power). `gspo compare --plan` reads the pilots: for
each preset, the per-seed spread of a paired difference of each judged figure, pooled over the
differences its stored study judged, with what it was measured at (seeds, steps, held-out problems,
a run's wall and evaluation seconds, the configurations' mean accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gspo.config import TrainConfig  # noqa: E402
from gspo.lab.compare import COMPARE_PRESETS  # noqa: E402
from gspo.lab.report import rerender, trained_minutes  # noqa: E402
from gspo.lab.studies import AXES  # noqa: E402

DOCS = ROOT / "docs"
PILOTS = ROOT / "gspo" / "lab" / "pilots.json"

# directory -> (the preset it ran, the options it ran with over the preset's base, the preset it pilots or None)
STORED = {
    "compare-default": ("paper", {}, "paper"),
    "compare-moe": ("moe", {}, "moe"),
    "compare-moe-search/fp32-sampler": ("moe", {"eval_size": 500}, None),  # the search's own seeds, 100-102
    "compare-moe-search/bf16-sampler": ("moe", {"eval_size": 500, "rollout_dtype": "bfloat16", "old_logp": "sampling"},
                                        None),
    "compare-lr1e-3": ("paper", {"lr": 1e-3}, None),
    "compare-corrections": ("paper", {"rollout_dtype": "bfloat16"}, None),
    "compare-length": ("length", {}, "length"),
    "compare-length/mb8": ("length", {"num_minibatches": 8}, None),
    "compare-length/mb16": ("length", {"num_minibatches": 16}, None),
    "compare-staleness": ("staleness", {}, "staleness"),
    "compare-staleness-full": ("staleness", {}, None),
    "compare-staleness-chain": ("staleness-chain", {}, "staleness-chain"),
    "compare-precision": ("precision", {}, "precision"),
    "compare-objectives": ("objectives", {}, "objectives"),
    "compare-distill": (None, {"model": "tiny", "steps": 60, "eval_every": 10}, None),
    "compare-weak-judge": (None, {"model": "tiny", "steps": 60, "eval_every": 10}, None),
}


def base_of(preset: str | None, options: dict) -> TrainConfig:
    return TrainConfig(**{**(COMPARE_PRESETS[preset].base if preset else {}), **options})


def pilot(out: Path, preset: str, base: TrainConfig, judged: dict, report: dict) -> dict:
    """A preset's pilot from its re-rendered study: the judged figures' pooled spreads and what they were
    measured at."""
    family = next(iter(report.values()))["judged"]
    seeds = sorted({int(s) for r in report.values() for s in r["seeds"]})
    runs = [v for r in report.values() for v in r["seeds"].values()]
    evals = [(v["eval_seconds"], v["eval_n"]) for v in runs if v.get("eval_seconds") and v.get("eval_n")]
    accs = [r["accuracy"] for r in report.values() if r.get("accuracy") is not None]
    n_runs, minutes, _ = trained_minutes(out, report)
    return {
        "source": str(out.relative_to(ROOT)),
        "seeds": len(seeds), "steps": base.run.steps, "configurations": len(report), "judged": family["judged"],
        "eval_n": min((int(v["eval_n"]) for v in runs if v.get("eval_n")), default=base.eval.eval_size),
        "accuracy": sum(accs) / len(accs),
        "run_seconds": 60 * minutes / max(n_runs, 1),
        # one run's evaluation seconds per held-out problem, all its evaluations together (None: not recorded)
        "eval_seconds_per_problem": sum(s / n for s, n in evals) / len(evals) if evals else None,
        "figures": {key: {"sd": m["sd"], "df": m["df"]} for key, m in family["mdd"].items() if m["sd"] is not None},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare pilots.json with the stored studies; write nothing")
    args = ap.parse_args()
    pilots, lines = {}, []
    for name, (preset, options, pilots_for) in STORED.items():
        out = DOCS / name
        if not (out / "compare.json").exists():
            print(f"{name}: no compare.json, skipped")
            continue
        base = base_of(preset, options)
        axis = AXES.get(COMPARE_PRESETS[preset].axis) if preset and COMPARE_PRESETS[preset].axis else None
        if args.check:
            import shutil
            import tempfile

            tmp = Path(tempfile.mkdtemp()) / name
            shutil.copytree(out, tmp)
            report = rerender(tmp, base, axis=axis, eval_n=base.eval.eval_size)
            report = json.loads((tmp / "compare.json").read_text())
        else:
            rerender(out, base, axis=axis, eval_n=base.eval.eval_size)
            report = json.loads((out / "compare.json").read_text())
        family = next(iter(report.values()))["judged"]
        mdd = "; ".join(f"{k} {100 * m['low']:.1f}-{100 * m['high']:.1f}" for k, m in family["mdd"].items()
                        if m["low"] is not None)
        n_runs, minutes, _ = trained_minutes(out, report)
        lines.append(f"{name}: {family['judged']} judged, {family['outside']} outside the noise; "
                     f"MDD (points) {mdd or 'none (one seed)'}; {n_runs} runs, {minutes:.1f} min")
        if pilots_for:
            pilots[pilots_for] = pilot(out, pilots_for, base, family, report)
    print("\n".join(lines))
    text = json.dumps(pilots, indent=2, sort_keys=True) + "\n"
    if args.check:
        same = PILOTS.exists() and json.loads(PILOTS.read_text()) == json.loads(text)
        print("pilots.json " + ("matches the stored studies" if same else "differs from the stored studies"))
        return 0 if same else 1
    PILOTS.write_text(text)
    print(f"wrote {PILOTS.relative_to(ROOT)} ({', '.join(pilots)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
