"""Multi-turn rollouts with a tool that waits on I/O: steps one after another vs in threads.

    python benchmarks/env_concurrency.py                      # ~1 minute on 2 CPU cores
    python benchmarks/env_concurrency.py --latency 0.2 --concurrency 1 8 32

The calculator task's episodes with the built-in `tiny-tool` model (8 prompts x 8 episodes,
up to 3 turns, 80 tokens a turn), its calculator tool made to wait `latency` seconds per call
as a remote tool would (a web search, a sandbox, a grader behind HTTP). The environment class
differs only in `concurrency` (gspo.tasks.env.Environment): how many episodes' steps of a turn run
at once, in threads. Each setting samples the same episodes from the same seed (checked:
same tokens), `repeats` times; reported: the median wall time of a rollout, of which the
model's sampling is the same in every row, and the speed-up over `concurrency = 1`, beside the
same rollout with tools that do not wait (the floor: the model's sampling and the
environments' own work).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the repository on sys.path)
import torch

from gspo.models.loading import load_policy
from gspo.sampling.episodes import Draws, EpisodeSpec, run_episodes
from gspo.sampling.rollout import PolicySampler, sampling_params
from gspo.tasks.calculator import CalculatorEnv, CalculatorTask, calculator


def slow_env(latency: float, concurrency: int) -> type:
    """CalculatorEnv whose tool waits `latency` s per call, with `concurrency` steps at once."""

    def slow_calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 12*34+5
        """
        time.sleep(latency)
        return calculator(expression)

    slow_calculator.__name__ = "calculator"  # the name the model was taught
    return type(f"SlowCalculator{concurrency}", (CalculatorEnv,), {"tools": [slow_calculator],
                                                                   "concurrency": concurrency})


def _timed(fn, *args):
    """(seconds, fn(*args))."""
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--latency", type=float, default=0.05, help="seconds each tool call waits")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_policy("tiny-tool")
    examples = CalculatorTask().test_set(args.prompts)
    params = sampling_params(tok, group_size=args.group_size, max_new_tokens=80)
    sampler = PolicySampler(model)

    def rollout(env_cls):
        return run_episodes(sampler, tok, examples, EpisodeSpec(env_cls, max_turns=3), params,
                            Draws(generator_for=lambda turn: torch.Generator().manual_seed(turn)))

    rollout(slow_env(0.0, 1))  # warm-up
    floor = statistics.median(_timed(rollout, slow_env(0.0, 1))[0] for _ in range(args.repeats))
    print(f"{args.prompts} prompts x {args.group_size} episodes, tool latency {args.latency * 1000:.0f} ms, "
          f"{args.threads} threads, median of {args.repeats}; the same rollout with tools that do not "
          f"wait: {floor:.2f} s")
    print("| concurrency | tool calls | rollout (s) | speed-up |")
    print("| --- | --- | --- | --- |")
    base, reference = None, None
    for n in args.concurrency:
        env_cls, times = slow_env(args.latency, n), []
        for _ in range(args.repeats):
            seconds, (ro, ep) = _timed(rollout, env_cls)
            times.append(seconds)
        if reference is None:
            reference = ro.completion_ids
        assert torch.equal(ro.completion_ids, reference), "the episodes differ between concurrency settings"
        t = statistics.median(times)
        base = base or t
        print(f"| {n} | {int(ep.tool_calls.sum())} | {t:.2f} | {base / t:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
