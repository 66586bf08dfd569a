"""The cost of PPO's value model: peak memory and step time against GRPO and GSPO.

    python benchmarks/ppo_cost.py                    # tiny and mid models, 2 CPU cores: ~3 minutes
    python benchmarks/ppo_cost.py --models mid --steps 6

The seeds' claim: PPO needs a value model about the size of the policy, "a considerable
memory and computational burden", which GRPO and GSPO remove. Each configuration runs in its
own process on identical work (same model, same prompts, every completion forced to the same
length by banning EOS until max_new_tokens) for `--steps` training steps after one warm-up
step; it reports the median step time and the growth of peak resident memory over the
process's baseline after imports (what the run itself allocated: weights, gradients,
optimizer state, activations). Ratios are relative to GSPO.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, Timer, median, model_path, n_params, peak_rss_mb

RUNS = [("gspo", {}), ("grpo", {}), ("ppo", {"critic": "separate"}), ("ppo", {"critic": "shared"})]


def worker(args) -> None:
    import torch
    import transformers  # noqa: F401  (imported before the baseline: libraries are not the run's memory)

    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run
    from gspo.train.trainer import train_step

    base_rss = peak_rss_mb()
    torch.set_num_threads(args.threads)
    extra = json.loads(args.extra)
    cfg = resolve(TrainConfig(algorithm=args.algorithm, model=model_path(args.model), steps=args.steps + 1,
                              prompts_per_step=args.prompts, group_size=args.group_size,
                              max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                              output_dir="/dev/null/unused", progress=False, threads=args.threads, **extra))
    run = build_run(cfg)
    times = []
    for step in range(1, cfg.steps + 1):
        with Timer() as t:
            train_step(run, step)
        if step > 1:  # the first step warms up allocators and kernels
            times.append(t.seconds)
    print(json.dumps({"step_seconds": median(times), "peak_rss_mb": peak_rss_mb(), "base_rss_mb": base_rss,
                      "params": n_params(run.policy)
                      + sum(n_params(t.model) for t in run.trainables[1:])  # a separate critic
                      + (n_params(run.critic.head) if hasattr(run.critic, "head") else 0)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny,mid")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--algorithm", default="gspo", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="tiny", help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    print(f"batch: {args.prompts} prompts x {args.group_size} completions x {args.max_new_tokens} tokens, "
          f"4 minibatches, fp32, {args.threads} threads; median of {args.steps} steps after a warm-up step\n")
    print("| model | configuration | parameters trained | median step (s) | x GSPO | "
          "peak memory growth (MiB) | x GSPO |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models.split(","):
        model_path(model)  # build once, outside the timed workers
        base = None
        for algorithm, extra in RUNS:
            cmd = [sys.executable, __file__, "--worker", "--algorithm", algorithm, "--model", model,
                   "--extra", json.dumps(extra), "--steps", str(args.steps), "--prompts", str(args.prompts),
                   "--group-size", str(args.group_size), "--max-new-tokens", str(args.max_new_tokens),
                   "--threads", str(args.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT / "benchmarks")
            if out.returncode != 0:
                raise SystemExit(out.stderr)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            grow = r["peak_rss_mb"] - r["base_rss_mb"]
            base = base or (r["step_seconds"], grow)
            name = algorithm + (f" ({extra['critic']} critic)" if extra else "")
            print(f"| {model} | {name} | {r['params'] / 1e6:.1f}M | {r['step_seconds']:.2f} | "
                  f"{r['step_seconds'] / base[0]:.2f} | {grow:.0f} | {grow / base[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
