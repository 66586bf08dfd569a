"""The integrity check's cost: recording receipts and checking a step's rows, at the sizes users train.

    python benchmarks/integrity.py [--prompts 32] [--group 8] [--prompt-tokens 200] [--tokens 512] [--turns 1]
                                   [--repeats 5] [--step-seconds S]

Builds what a step holds at those sizes (prompts × group rows; each row `--turns` model turns of
tokens/turns tokens with 20 environment tokens between them, as multi-turn episodes and agents lay
them out), records the samplers' receipts as gspo.sampling.integrity.Recorded does (one record
per turn's sampler call), and times `check_rows` over the rows, with torch on `--threads` threads
(the trainer's count: 1 on a 2-core machine). Prints the median of each over `--repeats`, per row
and per trained token, and, given `--step-seconds` (a step's time/step_seconds
from metrics.jsonl at the same sizes), the share of the step. The on-policy log-ratio check is a
per-row reduction over the first minibatch's (b, T) log-probs inside its loss: a few elementwise
operations next to the forward and backward it rides on (not timed here).
"""

import argparse
import random
import statistics
import time

import torch

from gspo.models.sequences import Rollout
from gspo.sampling.integrity import Receipts, check_rows


def build(prompts: int, group: int, prompt_tokens: int, tokens: int, turns: int, seed: int = 0):
    """(rollout, the samples' (prompt, completion ids, log-probs) as receipts take them)."""
    rng = random.Random(seed)
    vocab, env = 150_000, 20
    per_turn = tokens // turns
    rows, masks, logps, drawn, heads = [], [], [], [], []
    for _ in range(prompts):
        head = [rng.randrange(vocab) for _ in range(prompt_tokens)]
        for _ in range(group):
            row, mask, lp = [], [], []
            for t in range(turns):
                ids = [rng.randrange(vocab) for _ in range(per_turn)]
                lps = [-rng.random() * 5 for _ in range(per_turn)]
                drawn.append((head + row, ids, lps))
                row, mask, lp = row + ids, mask + [1.0] * per_turn, lp + lps
                if t < turns - 1:  # what came back: read, not trained
                    obs = [rng.randrange(vocab) for _ in range(env)]
                    row, mask, lp = row + obs, mask + [0.0] * env, lp + [0.0] * env
            rows.append(row)
            masks.append(mask)
            logps.append(lp)
            heads.append(head)
    T = max(map(len, rows))
    pad = lambda xs, v: [x + [v] * (T - len(x)) for x in xs]  # noqa: E731
    ro = Rollout(torch.tensor(heads), torch.ones(len(rows), prompt_tokens, dtype=torch.long),
                 torch.tensor(pad(rows, 0)), torch.tensor(pad(masks, 0.0)), torch.tensor(pad(logps, 0.0)),
                 torch.tensor([len(r) for r in rows]), torch.zeros(len(rows), dtype=torch.bool), group)
    return ro, drawn


def samples(drawn, turns: int) -> list:
    """The samplers' calls as Recorded sees them: one per turn, (prompts, Rollout of every row's completion)."""
    calls = []
    for t in range(turns):
        part = drawn[t::turns]
        n = len(part[0][1])
        prompts = [p for p, _, _ in part]
        calls.append((prompts, Rollout(torch.zeros(len(part), 1, dtype=torch.long), torch.ones(len(part), 1),
                                       torch.tensor([i for _, i, _ in part]), torch.ones(len(part), n),
                                       torch.tensor([lp for _, _, lp in part]), torch.full((len(part),), n),
                                       torch.zeros(len(part), dtype=torch.bool), 1)))
    return calls


def record(calls) -> Receipts:
    """Receipts as Recorded takes them: one `record` per sampler call."""
    receipts = Receipts()
    for prompts, ro in calls:
        receipts.record(prompts, ro)
    return receipts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--turns", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-seconds", type=float, default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (a 2-core run's trainer: 1)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    ro, drawn = build(a.prompts, a.group, a.prompt_tokens, a.tokens, a.turns)
    calls = samples(drawn, a.turns)
    rec, chk = [], []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        receipts = record(calls)
        t1 = time.perf_counter()
        breaches, checked = check_rows(ro, receipts)
        t2 = time.perf_counter()
        assert not breaches and checked == ro.prompt_ids.shape[0]
        rec.append(t1 - t0)
        chk.append(t2 - t1)
    rows, tokens = ro.prompt_ids.shape[0], int(ro.completion_mask.sum())
    r, c = statistics.median(rec), statistics.median(chk)
    print(f"rows {rows} ({a.prompts} x {a.group}), {a.turns} turn(s), {tokens} trained tokens "
          f"({a.prompt_tokens}-token prompts)")
    print(f"record receipts: {r * 1e3:.1f} ms ({r / rows * 1e6:.1f} us a row)")
    print(f"check rows:      {c * 1e3:.1f} ms ({c / rows * 1e6:.1f} us a row, {c / tokens * 1e9:.0f} ns a token)")
    if a.step_seconds:
        print(f"share of a {a.step_seconds:g} s step: record + check {(r + c) / a.step_seconds:.2%}")


if __name__ == "__main__":
    main()
