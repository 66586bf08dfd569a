"""Peak memory of one update as completions grow: bounded by the micro-batch token budget.

    python benchmarks/memory.py                                  # this checkout
    python benchmarks/memory.py --before /path/to/older/checkout # and a before/after table

A model of Qwen2.5-1.5B's width and vocabulary (hidden 1536, MLP 8960, 12 query and 2
key-value heads of 128, vocabulary 151,936, tied embeddings) with 2 decoder layers so that it
fits this machine, random weights, float32 master weights and AdamW state. One update (one
minibatch of `--rows` completions of L tokens after a 64-token prompt, every token trained,
ratios off-policy) is run in a fresh process for each L; the figure is the process's peak
resident memory during the update minus its resident memory before it (after loading and
the optimizer's first step, so AdamW's state is not counted as growth).

This checkout runs with --dtype bfloat16 (bf16 compute, float32 master weights) and
--micro-batch-tokens BUDGET; `--before DIR` runs an older gspo (which has neither) with float32
weights and the whole minibatch in one pass. A process that would pass `--limit-gib` is
stopped there (shown as "> limit") instead of taking the machine down.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=2, num_attention_heads=12,
             num_key_value_heads=2, head_dim=128, vocab=151_936)


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def model_dir(layers: int) -> str:
    """Random weights of the configuration, saved once (float32, ~1.3 GB) like a user's model."""
    sys.path.insert(0, str(HERE))
    from common import CACHE, padded_char_tokenizer

    path = CACHE / f"qwen2.5-1.5b-width-{layers}l"
    if not (path / "config.json").exists():
        import torch
        from transformers import Qwen3ForCausalLM

        from gspo.models.tiny import tiny_config

        kw = dict(SHAPE, num_hidden_layers=layers)
        vocab = kw.pop("vocab")
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(tiny_config(vocab, max_position_embeddings=16384, **kw))
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        padded_char_tokenizer(vocab).save_pretrained(path)
    return str(path)


def synthetic_batch(run, rows: int, length: int):
    """A scored batch of `rows` completions of `length` tokens after 64-token prompts."""
    import dataclasses

    import torch

    from gspo.models.sequences import Rollout
    from gspo.train.batch import Batch

    g = torch.Generator().manual_seed(0)
    V = run.policy.config.vocab_size
    prompt = torch.randint(3, V, (rows, 64), generator=g)
    comp = torch.randint(3, V, (rows, length), generator=g)
    ones = torch.ones(rows, length)
    logp = -torch.rand(rows, length, generator=g) * 5 * ones  # off-policy old log-probs
    ro = Rollout(prompt, torch.ones_like(prompt), comp, ones, logp, torch.full((rows,), length),
                 torch.zeros(rows, dtype=torch.bool), rows)
    adv = torch.randn(rows, generator=g)
    fields = {f.name for f in dataclasses.fields(Batch)}
    kw = dict(rollout=ro, rewards=adv, all_rewards=adv, reward_parts={}, advantages=adv, old_logp=logp,
              ref_logp=None, examples=[], completions=[""] * rows)
    return Batch(**{k: v for k, v in kw.items() if k in fields})


def child(args) -> None:
    limit = int(args.limit_gib * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if args.src:
        sys.path.insert(0, args.src)

    import torch

    from gspo.config import SECTION_OF, TrainConfig
    from gspo.train.run import build_run
    from gspo.train.trainer import update

    torch.set_num_threads(args.threads)
    known = set(SECTION_OF)
    want = dict(model=model_dir(args.layers), num_minibatches=1, prompts_per_step=1, group_size=args.rows,
                output_dir="/dev/null/unused", progress=False, lr=1e-6, max_new_tokens=args.length,
                threads=args.threads)
    if "micro_batch_tokens" in known:  # this checkout: mixed precision and a token budget
        want.update(dtype="bfloat16", micro_batch_tokens=args.budget)
    run = build_run(TrainConfig(**{k: v for k, v in want.items() if k in known}))
    warm = synthetic_batch(run, 1, 8)
    update(run, warm, torch.Generator().manual_seed(0))  # AdamW's state exists from here on
    base = rss_mb()
    batch = synthetic_batch(run, args.rows, args.length)
    t = time.perf_counter()
    update(run, batch, torch.Generator().manual_seed(1))
    print(json.dumps({"growth_mb": peak_mb() - base, "peak_mb": peak_mb(), "base_mb": base,
                      "seconds": time.perf_counter() - t}))


def measure(args, src: str | None, length: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--length", str(length), "--rows", str(args.rows),
           "--budget", str(args.budget), "--layers", str(args.layers), "--threads", str(args.threads),
           "--limit-gib", str(args.limit_gib)] + (["--src", src] if src else [])
    env = {**os.environ, "PYTHONPATH": src or str(HERE.parent)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        oom = "MemoryError" in out.stderr or "memory" in out.stderr.lower() or out.returncode < 0
        return {"error": "> limit" if oom else out.stderr.strip().splitlines()[-1][:120]}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--budget", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit-gib", type=float, default=20.0)
    ap.add_argument("--before", default=None, help="an older gspo checkout to measure beside this one")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    sys.path.insert(0, str(HERE.parent))
    model_dir(args.layers)  # build the weights once, outside the timed processes
    sides = [(f"this checkout (bf16 compute, fp32 master, budget {args.budget:d})", None)]
    if args.before:
        sides.insert(0, ("before (fp32, whole minibatch)", args.before))
    print("| side | completion tokens | minibatch tokens | peak growth | peak RSS | update time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, src in sides:
        for length in map(int, args.lengths.split(",")):
            r = measure(args, src, length)
            tokens = args.rows * (64 + length)
            if "error" in r:
                print(f"| {name} | {length} | {tokens} | {r['error']} | | |", flush=True)
            else:
                print(f"| {name} | {length} | {tokens} | {r['growth_mb']:.0f} MiB | {r['peak_mb']:.0f} MiB | "
                      f"{r['seconds']:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
