"""Where gspo's update goes, on the benchmark's mid-size model: forward, backward, optimizer, LM head.

    python benchmarks/update_parts.py                 # ~4 min on 2 CPU cores
    python benchmarks/update_parts.py --threads 1 --repeats 5

One rollout batch of `benchmarks/vs_trl.py`'s mid configuration (4 prompts x 8 completions x
128 tokens, fp32, 4 minibatches) is sampled once; its update is then timed again and again on
that same batch, whole and by part:

- forward: the policy's log-prob forward of one minibatch (transformer body and chunked LM head,
  with the entropy the trainer logs) and the loss;
- backward: `loss.backward()`;
- optimizer: gradient clipping and the AdamW step;
- the LM head alone: `gspo.models.lmhead.chunked_logprobs` forward and backward on the minibatch's hidden
  states (a part of forward and backward above);

and with one lever changed at a time: no entropy (`policy/entropy` not computed), packing
(`--packing`), a token budget per pass (`--micro-batch-tokens`). Medians over `--repeats`
updates; model FLOPs of the update (6 x params x trained tokens) over its time, as a share of
the measured fp32 matmul peak. Printed, not asserted: the figures are docs/performance.md's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import model_path
from vs_trl import CONFIGS, matmul_peak


def build(threads: int, **over):
    from gspo.config import TrainConfig
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run

    model, P, G, L = CONFIGS["mid"]
    cfg = resolve(TrainConfig(model=model_path(model), prompts_per_step=P, group_size=G, max_new_tokens=L,
                              min_new_tokens=L, num_minibatches=4, lr=1e-5, output_dir="-", progress=False,
                              threads=threads, **over))
    return build_run(cfg)


def parts(run, batch, repeats: int, entropy: bool = True, head_too: bool = False) -> dict:
    """Median seconds of each part of one update (all its minibatches), over `repeats` updates."""
    from gspo.algo.aggregation import agg_count
    from gspo.models.lmhead import chunked_logprobs
    from gspo.models.logprobs import Split, passes
    from gspo.train import trainer

    cfg, ro = run.cfg, batch.rollout
    mask = ro.completion_mask
    B = mask.shape[0]
    out = {"forward": [], "backward": [], "optimizer": [], "head": [], "update": []}
    head = run.policy.get_output_embeddings().weight
    for _ in range(repeats):
        order = torch.randperm(B, generator=torch.Generator().manual_seed(0))
        fwd = bwd = opt = hd = 0.0
        t_update = time.perf_counter()
        for idx in order.split(B // cfg.loss.num_minibatches):
            total = trainer.Totals(float(agg_count(mask[idx], cfg.loss.loss_agg)), float(mask[idx].sum()))
            for m in passes(ro, Split(cfg.policy.micro_batch_tokens, 0, run.packed).groups(ro, idx),
                            cfg.policy.micro_batch_tokens):
                t = time.perf_counter()
                if entropy:
                    loss, _, _ = trainer._loss(run, batch, m, total, None)
                else:  # the same forward and loss, less the entropy
                    logp, _, _ = run.train_model(m.rollout, temperature=cfg.sampling.temperature, packed=run.packed)
                    loss = -(logp * m.rollout.completion_mask).sum() / total[1]
                fwd += time.perf_counter() - t
                t = time.perf_counter()
                loss.backward()
                bwd += time.perf_counter() - t
            t = time.perf_counter()
            trainer.optimizer_step(run)
            opt += time.perf_counter() - t
            if head_too:  # the LM head alone, on this minibatch's final hidden states (not the update's time)
                t_head = time.perf_counter()
                with torch.no_grad():
                    hidden = run.policy.model(input_ids=ro.input_ids[idx],
                                              attention_mask=ro.attention_mask[idx]).last_hidden_state
                T = mask.shape[1]  # the completion's positions, as gspo.models.logprobs takes them
                h = hidden[:, -T - 1:-1].reshape(-1, hidden.shape[-1]).detach().requires_grad_(True)
                targets = ro.input_ids[idx][:, -T:].reshape(-1)
                t = time.perf_counter()
                lp = chunked_logprobs(h, head, targets, 1.0, entropy=True)
                lp[0].sum().backward()
                hd += time.perf_counter() - t
                head.grad = None
                t_update += time.perf_counter() - t_head
        out["update"].append(time.perf_counter() - t_update)
        for k, v in (("forward", fwd), ("backward", bwd), ("optimizer", opt), ("head", hd)):
            out[k].append(v)
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from gspo.train.trainer import train_step

    peak = matmul_peak(args.threads)
    print(f"machine: {args.threads} threads, fp32 matmul peak {peak:.0f} GFLOP/s\n")
    rows = []
    for name, over, entropy in (("as the trainer runs it", {}, True),
                                ("no entropy", {}, False),
                                ("--packing", {"packing": True}, True),
                                ("--micro-batch-tokens 1024", {"micro_batch_tokens": 1024}, True)):
        run = build(args.threads, **over)
        _, batch = train_step(run, 1)  # the batch the updates below are timed on (its own update warms up)
        p = parts(run, batch, args.repeats, entropy, head_too=not rows)
        params = sum(x.numel() for x in run.policy.parameters())
        tokens = int(batch.rollout.attention_mask.sum())
        gflop = 6 * params * tokens / 1e9
        rows.append((name, p, gflop))
        head = f" (the LM head's forward+backward alone: {p['head']:.2f} s)" if len(rows) == 1 else ""
        print(f"{name}: update {p['update']:.2f} s = forward {p['forward']:.2f} + backward {p['backward']:.2f} "
              f"+ optimizer {p['optimizer']:.2f}{head}; "
              f"{gflop:.0f} GFLOP, {gflop / p['update']:.1f} GFLOP/s, {100 * gflop / p['update'] / peak:.1f}% of peak",
              flush=True)
    print("\n| update | total | forward (+ loss) | backward | optimizer | LM head fwd+bwd alone | "
          "% of fp32 matmul peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, (name, p, gflop) in enumerate(rows):
        head = f"{p['head']:.2f} s" if i == 0 else "-"  # measured with the first configuration only
        print(f"| {name} | {p['update']:.2f} s | {p['forward']:.2f} s | {p['backward']:.2f} s | {p['optimizer']:.2f} s "
              f"| {head} | {100 * gflop / p['update'] / peak:.1f}% |")


if __name__ == "__main__":
    main()
