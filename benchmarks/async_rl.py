"""Synchronous against asynchronous RL (rollout workers, --max-staleness K) on the same run: speed and learning.

    python benchmarks/async_rl.py                          # default task (arithmetic), default steps (60), seed 0
    python benchmarks/async_rl.py --steps 40 --seed 1      # shorter, another seed
    python benchmarks/async_rl.py --with-fixed-lag         # also K=1 sampled in the trainer's process
    python benchmarks/async_rl.py --extra "--loss grpo"    # more gspo flags, for every variant

Each variant is one `python -m gspo train` in a process of its own, all with the same seed,
task and steps, and all with `--threads 1`: on a 2-core machine the trainer and its rollout
worker then get one core each, and the synchronous run gets the same one thread per process
(a synchronous run with two threads would be the fairer speed baseline on two idle cores; the
issue asks for the same model work per process). Variants:

- sync: --max-staleness 0, the trainer samples each batch itself (today's loop);
- sync, recompute: the same with --old-logp recompute, the extra forward pass every K > 0 run
  makes (pi_old is then the proximal policy, recomputed: docs/async.md), to tell its cost from
  the workers' effect;
- workers K=1: --rollout-workers 1 --max-staleness 1;
- workers K=2: --rollout-workers 1 --max-staleness 2;
- fixed-lag K=1 (--with-fixed-lag): --rollout-workers 0 --max-staleness 1, the same batches as
  workers K=1, sampled in the trainer's process (no overlap; bit for bit the same training).

Printed, one row per variant, from <out>/<variant>/summary.json and metrics.jsonl:

- wall s: the run's wall_seconds (model load, evaluation before and after, all steps);
- steps s: the sum of time/step_seconds over the steps (the training loop alone, step 1 with the
  workers' start included);
- s/step: the mean of time/step_seconds over steps 2..;
- tok/s: the mean of time/tokens_per_second over steps 2.. (step 1 holds the workers' start);
- acc: held-out greedy accuracy before -> after (+points);
- stale mean/max: the mean over steps of async/staleness_mean, and the largest async/staleness_max;
- overlap: the mean of async/overlap over steps 2.. (the share of a batch's sampling time the
  trainer did not wait for);
- idle s/step: the mean of async/trainer_idle_seconds over steps 2.. (the trainer waiting for its
  batch; "-" for the synchronous run, which logs no async/... metrics: it samples every batch itself);
- rollout s/step, update s/step: the means of time/rollout_seconds (sampling, or waiting for the
  batch) and time/update_seconds (the optimizer updates) over steps 2..;
- speed: the synchronous run's s/step divided by this one's (>1: faster).

Exits non-zero if a variant fails. The runs stay in --out (default: a fresh temporary folder).
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
from pathlib import Path

from common import mean_of, train_variant, variant_dir

VARIANTS = {
    "sync": ["--max-staleness", "0"],
    "sync, recompute": ["--max-staleness", "0", "--old-logp", "recompute"],
    "workers K=1": ["--rollout-workers", "1", "--max-staleness", "1"],
    "workers K=2": ["--rollout-workers", "1", "--max-staleness", "2"],
    "fixed-lag K=1": ["--rollout-workers", "0", "--max-staleness", "1"],
}


def run_variant(name: str, flags: list[str], args, out: Path) -> dict:
    run_dir = variant_dir(out, name)
    cmd = [sys.executable, "-m", "gspo", "train", "--seed", str(args.seed), "--threads", "1",
           "--output-dir", str(run_dir), "--no-progress", *flags, *shlex.split(args.extra)]
    if args.steps is not None:
        cmd += ["--steps", str(args.steps)]
    ran = train_variant(name, cmd, run_dir)
    if ran is None:
        return {"name": name, "failed": True}
    summary, rows, seconds = ran
    later = rows[1:] or rows

    def mean(key, rs=later):
        return mean_of(rs, key)

    return {
        "name": name, "failed": False, "process_seconds": seconds,
        "wall": summary["wall_seconds"],
        "loop": sum(r["time/step_seconds"] for r in rows), "per_step": mean("time/step_seconds"),
        "tok_s": mean("time/tokens_per_second"),
        "before": (summary.get("eval_before") or {}).get("accuracy"),
        "after": (summary.get("eval_after") or {}).get("accuracy"),
        "stale_mean": mean("async/staleness_mean", rows),
        "stale_max": max((r["async/staleness_max"] for r in rows if "async/staleness_max" in r), default=None),
        "overlap": mean("async/overlap"), "idle": mean("async/trainer_idle_seconds"),
        "rollout": mean("time/rollout_seconds"), "update": mean("time/update_seconds"),
        "steps": len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the task's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for the runs (default: a fresh temporary folder)")
    p.add_argument("--extra", default="", help="more gspo train flags for every variant, one string")
    p.add_argument("--with-fixed-lag", action="store_true", help="also --rollout-workers 0 --max-staleness 1")
    args = p.parse_args()

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-async-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [n for n in VARIANTS if args.with_fixed_lag or n != "fixed-lag K=1"]
    results = [run_variant(n, VARIANTS[n], args, out) for n in names]

    print(f"\nmachine: {platform.machine()}, {os.cpu_count()} CPU cores, {platform.python_version()}; "
          f"every variant --threads 1 (trainer and rollout worker one thread each); seed {args.seed}; runs in {out}")
    head = ("| variant | wall s | steps s | s/step | tok/s | acc before -> after | stale mean/max | overlap | "
            "idle s/step | rollout s/step | update s/step | speed |")
    print(head)
    print("|" + " --- |" * (head.count("|") - 1))
    base = next((r for r in results if r["name"] == "sync" and not r["failed"]), None)
    for r in results:
        if r["failed"]:
            print(f"| {r['name']} | failed |" + " |" * (head.count("|") - 3))
            continue
        speed = f"{base['per_step'] / r['per_step']:.2f}x" if base else "-"
        acc = ("-" if r["before"] is None or r["after"] is None else  # --eval-size 0
               f"{100 * r['before']:.1f}% -> {100 * r['after']:.1f}% ({100 * (r['after'] - r['before']):+.1f})")
        stale = "0/0" if r["stale_mean"] is None else f"{r['stale_mean']:.2f}/{r['stale_max']:.0f}"
        overlap = "-" if r["overlap"] is None else f"{r['overlap']:.2f}"
        idle = "-" if r["idle"] is None else f"{r['idle']:.3f}"
        print(f"| {r['name']} | {r['wall']:.1f} | {r['loop']:.1f} | {r['per_step']:.3f} | {r['tok_s']:.0f} | "
              f"{acc} | {stale} | {overlap} | {idle} | {r['rollout']:.3f} | {r['update']:.3f} | {speed} |")
    if any(r["failed"] for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
