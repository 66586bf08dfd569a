"""Build the built-in tiny models shipped in gspo/assets (about 4 and 10 minutes on 2 CPU cores).

    python scripts/make_tiny_model.py                  # writes gspo/assets/tiny (dense)
    python scripts/make_tiny_model.py --arch moe       # writes gspo/assets/tiny-moe (8 experts, top-2)
    python scripts/make_tiny_model.py --arch moe --experts 32 --top-k 8 --moe-size 48 --out gspo/assets/tiny-moe-wide
                                                       # Qwen3-MoE's 128/8 shape scaled down (docs/moe.md)
    python scripts/make_tiny_model.py --out /tmp/tiny  # somewhere else

What it makes. A 4-layer Qwen3 (0.8M parameters; `--arch moe`: a 4-layer Qwen3-MoE with 8
experts, top-2, the same active size; character tokenizer built locally with `tokenizers`)
warm-started by supervised training on the built-in arithmetic task's
training problems (never its test split), where answers that need a carry or a borrow are
written, with probability `--bug-rate` (0.6), with one of the two classic schoolchild
mistakes instead:

    forgot to carry       58+67  -> 15    (each column's digit sum mod 10)
    smaller from larger   52-17  -> 45    (each column's |difference|)

The model learns both the right method and the bug, and prefers the bug where it applies.
Greedy decoding therefore gets only the no-carry problems right (about a fifth of them),
while sampling finds the right answer often: rewards vary within a group, which is the
regime where RL with group-relative advantages improves a model quickly (it sharpens what
the model already knows). The README's figures come from this model.

The MoE model trains with the router load-balancing loss (coefficient 0.01) so that its
experts stay in use.

Deterministic: the same seed, torch version and thread count give the same weights.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo.models.loading import ASSETS  # noqa: E402
from gspo.models.tiny import build_char_tokenizer, tiny_config, tiny_moe_config
from gspo.tasks import get_task  # noqa: E402
from gspo.train.evaluation import EvalOptions, evaluate  # noqa: E402


def buggy_answer(a: int, b: int, op: str) -> str:
    """Column-wise arithmetic without carries (+) or with smaller-from-larger digits (-).

    >>> buggy_answer(58, 67, "+"), buggy_answer(52, 17, "-"), buggy_answer(12, 3, "+")
    ('15', '45', '15')
    """
    da, db = str(a)[::-1], str(b)[::-1]
    cols = []
    for i in range(max(len(da), len(db))):
        x = int(da[i]) if i < len(da) else 0
        y = int(db[i]) if i < len(db) else 0
        cols.append((x + y) % 10 if op == "+" else abs(x - y))
    return str(int("".join(str(c) for c in reversed(cols))))


def sft_batch(problems, tokenizer, rng: random.Random, bug_rate: float):
    """Token ids, attention mask and labels (completion tokens only) for one SFT batch."""
    seqs, starts = [], []
    for p in problems:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", p.prompt).groups()
        bug = buggy_answer(int(a), int(b), op)
        answer = bug if bug != p.answer and rng.random() < bug_rate else p.answer
        prompt = tokenizer(p.prompt)["input_ids"]
        seqs.append(prompt + tokenizer(answer)["input_ids"] + [tokenizer.eos_token_id])
        starts.append(len(prompt))
    return pad_sft(seqs, starts, tokenizer)


def pad_sft(seqs: list[list[int]], starts: list[int], tokenizer):
    """Right-padded ids, attention mask and labels (-100 before each sequence's `start`: the
    loss covers the completion and EOS only) of prompt+completion token sequences."""
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
        labels[i, start:len(s)] = torch.tensor(s[start:])
    return ids, mask, labels


def sft_optimizer(model, lr: float, steps: int, warmup: int):
    """AdamW (no weight decay) and its schedule for a warm-start: linear warm-up over `warmup`
    steps, then linear decay to 5% of `lr` at `steps`."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.05, 1.0 - s / steps))
    return opt, sched


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", choices=["dense", "moe"], default="dense")
    ap.add_argument("--out", default=None, help="default: gspo/assets/tiny (dense) or gspo/assets/tiny-moe")
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bug-rate", type=float, default=0.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8, help="--arch moe: experts per layer (default 8)")
    ap.add_argument("--top-k", type=int, default=2, help="--arch moe: experts each token activates (default 2)")
    ap.add_argument("--moe-size", type=int, default=192, help="--arch moe: each expert's intermediate size")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    tokenizer = build_char_tokenizer()
    from transformers import AutoModelForCausalLM

    config = tiny_config(len(tokenizer)) if args.arch != "moe" else tiny_moe_config(
        len(tokenizer), num_experts=args.experts, num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_size)
    model = AutoModelForCausalLM.from_config(config)
    moe = args.arch == "moe"
    task = get_task(args.task)
    opt, sched = sft_optimizer(model, args.lr, args.steps, warmup=100)
    t0 = time.time()
    model.train()
    for step in range(args.steps):
        # a stream of its own (seed 10_000 + ...), never the test split
        problems = task.train_batch(step, args.batch_size, seed=10_000 + args.seed)
        ids, mask, labels = sft_batch(problems, tokenizer, rng, args.bug_rate)
        extra = {"output_router_logits": True} if moe else {}  # adds the load-balancing loss
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, **extra).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if (step + 1) % 500 == 0:
            print(f"step {step + 1}/{args.steps} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
    model.eval()
    from gspo.rewards.builtin import load_rewards

    res = evaluate(model, tokenizer, task, load_rewards(["exact_integer"], None), EvalOptions(n=1000, k=8))
    print(f"greedy accuracy {res['accuracy']:.3f}  sample accuracy {res['sample_accuracy']:.3f}  "
          f"pass@8 {res['pass@8']:.3f}")
    out = Path(args.out or ASSETS / ("tiny-moe" if moe else "tiny"))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved to {out}")


if __name__ == "__main__":
    main()
