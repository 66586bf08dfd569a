"""Build the built-in long-answer models shipped in gspo/assets for the `chain` task.

    python scripts/make_long_model.py                  # writes gspo/assets/tiny-long (dense)
    python scripts/make_long_model.py --arch moe       # writes gspo/assets/tiny-long-moe (8 experts, top-2)
    python scripts/make_long_model.py --arch moe --experts 16 --top-k 4 --out /tmp/long-moe16   # a stress knob

What it makes. `tiny-long`: the built-in dense architecture (`gspo.models.loading.tiny_config`, a
4-layer Qwen3, hidden 128) with 384 positions and the same character tokenizer, warm-started
by supervised training on the `chain` task's training problems (never its test split), whose
steps are written with one schoolchild mistake, *forgetting the carry when the ones make ten*:

    955+65=1020  is written, with probability --bug-rate (0.7), as  955+65=1010

(5 + 5 make exactly ten: the 0 is written and the carried 1 forgotten). Every later step goes
on from the wrong total, so the final total is off. The model learns the method and the bug
and prefers the bug where it applies: greedy decoding gets right the chains where it never
applies, sampling often writes the right sum at those steps. This is the regime where RL with
group-relative advantages sharpens the model quickly, over answers of 55 to 217 tokens.

`tiny-long-moe`: a 4-layer Qwen3-MoE, 8 experts, top-2, upcycled from `tiny-long` (every
expert starts as the dense MLP plus 5% noise, the routers new; Komatsuzaki et al. 2022) and
trained further on the same data with the router load-balancing loss, so that the experts
part ways and routing matters. `--experts` and `--top-k` build larger ones.

Deterministic: the same seed, torch version and thread count give the same weights.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # make_tiny_model, beside this script

from make_tiny_model import pad_sft, sft_optimizer  # noqa: E402

from gspo.models.loading import ASSETS  # noqa: E402
from gspo.models.tiny import build_char_tokenizer, tiny_config, tiny_moe_config
from gspo.rewards.builtin import load_rewards  # noqa: E402
from gspo.tasks import get_task  # noqa: E402
from gspo.tasks.chain import LENGTH_BINS, TARGET, parse_prompt  # noqa: E402
from gspo.train.evaluation import EvalOptions, evaluate  # noqa: E402

MAX_POSITIONS = 384


def makes_ten(total: int, term: int) -> bool:
    """The ones digits add up to exactly ten (where the bug applies).

    >>> makes_ten(955, 65), makes_ten(904, 65), makes_ten(990, 10)
    (True, False, False)
    """
    return total % 10 + term % 10 == 10


def buggy_steps(a: int, d: int, rng: random.Random, bug_rate: float) -> str:
    """The chain of steps until the total reaches 1000, where a step whose ones make ten
    forgets the carry with probability `bug_rate`; later steps continue from what was written.

    >>> buggy_steps(890, 65, random.Random(0), 1.0), buggy_steps(890, 65, random.Random(0), 0.0)
    ('890+65=955 955+65=1010', '890+65=955 955+65=1020')
    """
    steps, total = [], a
    while total < TARGET:
        new = total + d
        if makes_ten(total, d) and rng.random() < bug_rate:
            new -= 10  # the carried one is forgotten
        steps.append(f"{total}+{d}={new}")
        total = new
    return " ".join(steps)


def sft_batch(problems, tokenizer, rng: random.Random, bug_rate: float):
    """Token ids, attention mask and labels (completion tokens and EOS only) for one SFT batch."""
    seqs, starts = [], []
    for p in problems:
        prompt = tokenizer(p.prompt)["input_ids"]
        answer = buggy_steps(*parse_prompt(p.prompt), rng, bug_rate)
        seqs.append(prompt + tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    return pad_sft(seqs, starts, tokenizer)


class _Subset:
    """The rows of a task's test split whose chain length is in [lo, hi] (for `evaluate`)."""

    def __init__(self, task, n: int, lo: int, hi: int):
        self.rows = [ex for ex in task.test_set(n) if lo <= ex.columns["n_steps"] <= hi]

    def test_set(self, n=None):
        return self.rows[: n or len(self.rows)]


def report(model, tokenizer, task, n: int, k: int, by_length: bool = True) -> dict:
    rewards = load_rewards(list(task.default_rewards), None)
    kw = dict(k=k, max_new_tokens=task.default_max_new_tokens, batch_size=128)
    res = evaluate(model, tokenizer, task, rewards, EvalOptions(n=n, **kw))
    print(f"held-out (n={res['n']}): greedy accuracy {res['accuracy']:.3f}  sample accuracy "
          f"{res['sample_accuracy']:.3f}  pass@{k} {res[f'pass@{k}']:.3f}", flush=True)
    if by_length:
        for lo, hi in LENGTH_BINS:
            sub = _Subset(task, n, lo, hi)
            r = evaluate(model, tokenizer, sub, rewards, EvalOptions(n=len(sub.rows), **kw))
            print(f"  {lo:2d}-{hi:2d} steps (n={r['n']:3d}): greedy {r['accuracy']:.3f}  "
                  f"sample {r['sample_accuracy']:.3f}  pass@{k} {r[f'pass@{k}']:.3f}", flush=True)
    return res


def upcycle(dense, config, noise: float, generator: torch.Generator):
    """A Qwen3-MoE whose every expert starts as the dense model's MLP (sparse upcycling,
    Komatsuzaki et al. 2022), plus relative noise `noise` so that the experts can part ways;
    attention, norms and embeddings are the dense model's, the routers new. With noise 0 the
    MoE model computes exactly what the dense one does (top-k gates renormalised to sum to 1)."""
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(config)
    dense_sd, sd = dense.state_dict(), moe.state_dict()
    E = config.num_experts
    for key in sd:
        if key in dense_sd:
            sd[key] = dense_sd[key].clone()
    for i in range(config.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp."
        gate_up = torch.cat([dense_sd[mlp + "gate_proj.weight"], dense_sd[mlp + "up_proj.weight"]], 0)  # (2I, H)
        down = dense_sd[mlp + "down_proj.weight"]  # (H, I)
        for name, w in (("experts.gate_up_proj", gate_up), ("experts.down_proj", down)):
            jitter = torch.randn((E, *w.shape), generator=generator) * (noise * float(w.std()))
            sd[mlp + name] = w.expand(E, *w.shape).clone() + jitter  # (E, ...)
    moe.load_state_dict(sd)
    return moe


def build_model(args, tokenizer):
    from transformers import AutoModelForCausalLM

    size = {"max_position_embeddings": MAX_POSITIONS}
    if args.arch == "dense":
        return AutoModelForCausalLM.from_pretrained(args.init) if args.init else \
            AutoModelForCausalLM.from_config(tiny_config(len(tokenizer), **size))
    dense = AutoModelForCausalLM.from_pretrained(args.init or ASSETS / "tiny-long")
    inter = dense.config.intermediate_size  # every expert the size of the dense MLP
    config = tiny_moe_config(len(tokenizer), num_experts=args.experts, num_experts_per_tok=args.top_k,
                             moe_intermediate_size=inter, intermediate_size=inter, **size)
    exact = upcycle(dense, config, 0.0, torch.Generator().manual_seed(args.seed))
    ids = torch.tensor([tokenizer("12+34+56=12+34=46 46+56=102")["input_ids"]])
    with torch.no_grad():  # the layouts agree: the upcycled model is the dense model before the noise
        gap = (exact(ids).logits - dense(ids).logits).abs().max().item()
    assert gap < 1e-4, f"upcycled model differs from the dense model by {gap}"
    return upcycle(dense, config, args.noise, torch.Generator().manual_seed(args.seed))


def sft(model, tokenizer, task, args, moe: bool) -> None:
    """Supervised warm-start on buggy chains (module docstring); AdamW, warm-up then linear decay."""
    rng = random.Random(args.seed)
    opt, sched = sft_optimizer(model, args.lr, args.steps, warmup=min(100, args.steps // 5))
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        # a stream of its own (seed 10_000 + ...), never the test split; two micro-batches of
        # similar lengths (short and long half) waste less on padding than one
        problems = sorted(task.train_batch(step, args.batch_size, seed=10_000 + args.seed + 7 * moe),
                          key=lambda p: len(p.prompt))
        half = len(problems) // 2
        parts = [sft_batch(part, tokenizer, rng, args.bug_rate) for part in (problems[:half], problems[half:])]
        total_tokens = sum(int((labels != -100).sum()) for _, _, labels in parts)
        opt.zero_grad()
        for ids, mask, labels in parts:
            extra = {"output_router_logits": True} if moe else {}  # adds the load-balancing loss
            out = model(input_ids=ids, attention_mask=mask, labels=labels, **extra)
            # each half weighted by its share of the completion tokens: the step's loss is a token mean
            (out.loss * (int((labels != -100).sum()) / total_tokens)).backward()
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            print(f"step {step + 1}/{args.steps} loss {out.loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            model.eval()
            report(model, tokenizer, task, 100, 4, by_length=False)
            model.train()
    print(f"trained {args.steps} steps in {time.time() - t0:.0f}s", flush=True)
    model.eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["dense", "moe"], default="dense")
    ap.add_argument("--out", default=None, help="default: gspo/assets/tiny-long (dense) or gspo/assets/tiny-long-moe")
    ap.add_argument("--init", default=None, help="dense: continue from this model; moe: the dense model to upcycle "
                                                 "(default gspo/assets/tiny-long)")
    ap.add_argument("--steps", type=int, default=None, help="default 2400 (dense), 300 (moe)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=None, help="default 3e-3 (dense), 1e-3 (moe)")
    ap.add_argument("--bug-rate", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="--arch moe: experts per layer (a stress knob)")
    ap.add_argument("--top-k", type=int, default=2, help="--arch moe: experts per token")
    ap.add_argument("--noise", type=float, default=0.05, help="--arch moe: relative noise added to each expert copy")
    ap.add_argument("--eval-n", type=int, default=500, help="held-out problems for the final report (0: none)")
    ap.add_argument("--eval-k", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also report greedy accuracy on 100 problems every N steps")
    args = ap.parse_args()
    moe = args.arch == "moe"
    args.steps = args.steps or (300 if moe else 2400)
    args.lr = args.lr or (1e-3 if moe else 3e-3)

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = build_char_tokenizer()
    model = build_model(args, tokenizer)
    task = get_task("chain")
    t0 = time.time()
    sft(model, tokenizer, task, args, moe)
    if args.eval_n:
        report(model, tokenizer, task, args.eval_n, args.eval_k)
    out = Path(args.out or ASSETS / ("tiny-long-moe" if moe else "tiny-long"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved to {out} in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
