"""Multi-turn rollouts with each episode's KV cache kept between turns vs every turn prefilled whole.

    python benchmarks/multiturn_cache.py                 # ~1 minute on 2 quiet CPU cores
    python benchmarks/multiturn_cache.py --steps 1 2 3 --repeats 5

The rollout of `gspo train --task calculator` with its defaults (built by gspo.train.run.build_run and
sampled by gspo.sampling.produce.rollout, as training samples it: 32 prompts x 8 episodes, up to 3 turns,
80 tokens a turn, the built-in `tiny-tool` model), once with gspo's own sampler keeping each
episode's KV cache from one turn to the next (gspo.sampling.turncache: a later turn feeds its last sampled
token and the environment's tokens) and once with `PolicySampler(keep_cache=False)`, every turn
prefilling its whole conversation. Same seed, same weights: the tokens must be identical (checked)
and the log-probs equal to 1e-5. Reported per turn: the rows sampled, the `sample` call's wall time
and, of it, the prefill (re-prefill: the conversations' forward; kept: the chunk fed after the
cache, selection of rows included); and the whole rollout (environments included). Medians of
`repeats` runs of each, alternating, after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict

import common  # noqa: F401  (puts the repository on sys.path)
import torch

import gspo.sampling.rollout as rollout_module
from gspo.config import TrainConfig
from gspo.sampling.produce import rollout
from gspo.sampling.rollout import PolicySampler
from gspo.sampling.turncache import TurnCache
from gspo.train.run import build_run


class Clock:
    """Wall times of `sample` calls and of the prefill (or chunk) inside each, per rollout."""

    def __init__(self):
        self.samples, self.prefills = [], []

    def install(self) -> None:
        sample, prefill, resume = PolicySampler.sample, rollout_module._prefill, TurnCache.resume

        def timed(store, fn):
            def wrapped(*a, **kw):
                t0 = time.perf_counter()
                out = fn(*a, **kw)
                store.append((time.perf_counter() - t0, a))
                return out
            return wrapped

        PolicySampler.sample = timed(self.samples, sample)
        rollout_module._prefill = timed(self.prefills, prefill)
        resume_timed = timed(self.prefills, resume)

        def resumed(self_, *a, **kw):  # a resume that falls back is timed with the prefill that follows
            out = resume_timed(self_, *a, **kw)
            if out is None:
                self.prefills.pop()
            return out

        TurnCache.resume = resumed

    def take(self) -> tuple[list[float], list[float], list[int]]:
        """(sample seconds, prefill seconds, rows) per turn of the rollout just sampled."""
        turns = [t for t, _ in self.samples]
        rows = [len(a[1]) * a[2].group_size for _, a in self.samples]
        prefills = [t for t, _ in self.prefills]
        assert len(prefills) == len(turns)
        del self.samples[:], self.prefills[:]  # in place: the wrappers hold these lists
        return turns, prefills, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, nargs="+", default=[1], help="training steps whose prompts are sampled")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = build_run(TrainConfig(task="calculator", output_dir=f"{tmp}/run", progress=False,
                                    threads=args.threads))
    cfg = run.cfg
    samplers = {"re-prefill": PolicySampler(run.policy, keep_cache=False), "kept cache": PolicySampler(run.policy)}
    clock = Clock()
    clock.install()
    print(f"gspo train --task calculator's rollout: {cfg.sampling.prompts_per_step} prompts x "
          f"{cfg.sampling.group_size} episodes, up to {run.max_turns} turns, {cfg.sampling.max_new_tokens} tokens a "
          f"turn, episode budget {cfg.episodes.max_episode_tokens}, {cfg.policy.model}; {args.threads} threads, "
          f"median of {args.repeats}")
    for step in args.steps:
        examples = run.task.train_batch(step, cfg.sampling.prompts_per_step, cfg.run.seed)
        times = {name: defaultdict(list) for name in samplers}
        out = {}
        for r in range(args.repeats + 1):  # the first: a warm-up
            for name, sampler in samplers.items():
                run.sampler = sampler
                t0 = time.perf_counter()
                ro, _, _, ep = rollout(run, examples, step)
                total = time.perf_counter() - t0
                turns, prefills, rows = clock.take()
                if r == 0:
                    out[name] = (ro, ep, rows)
                    continue
                times[name]["total"].append(total)
                for k, (t, p) in enumerate(zip(turns, prefills)):
                    times[name][k].append((t, p))
        (a, ep_a, rows), (b, ep_b, _) = out["re-prefill"], out["kept cache"]
        for name in ("completion_ids", "completion_mask", "env_mask", "lengths", "truncated"):
            assert torch.equal(getattr(a, name), getattr(b, name)), f"{name} differ"
        assert ep_a.transcripts == ep_b.transcripts and torch.equal(ep_a.turns, ep_b.turns)
        torch.testing.assert_close(a.logp, b.logp, rtol=1e-5, atol=1e-5)
        print(f"\nstep {step}: identical tokens; log-probs differ by at most "
              f"{float((a.logp - b.logp).abs().max()):.1e}")
        print("| turn | rows | re-prefill: sample (s) | of which prefill | kept cache: sample (s) | of which chunk |")
        print("| --- | --- | --- | --- | --- | --- |")
        for k, n in enumerate(rows):
            cells = []
            for name in samplers:
                t, p = zip(*times[name][k])
                cells += [f"{statistics.median(t):.2f}", f"{statistics.median(p):.2f}"]
            print(f"| {k} | {n} | " + " | ".join(cells) + " |")
        full, kept = (statistics.median(times[name]["total"]) for name in samplers)
        print(f"| rollout | {len(ep_a.turns)} episodes | {full:.2f} | | {kept:.2f} | |  ({full / kept:.2f}x)",
              flush=True)


if __name__ == "__main__":
    main()
