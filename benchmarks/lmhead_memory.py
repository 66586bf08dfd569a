"""Peak memory of the policy loss through the LM head: gspo's chunked path vs full fp32 logits.

    python benchmarks/lmhead_memory.py                  # V = 151,936, 8,192 tokens, H = 1024 (~2 min, ~20 GB free RAM)
    python benchmarks/lmhead_memory.py --tokens 2048    # smaller

The work: the last hidden states of 8,192 completion tokens (16 responses x 512) through a
Qwen3-size head (151,936 x 1024, fp32, trainable), the log-prob of each sampled token, the
GSPO loss, and the backward pass to the hidden states and the head. Each path runs in its
own process; reported is the growth of peak resident memory once the inputs exist (hidden
states, head weight, targets): what the loss's forward and backward allocate.

- full: logits = h W^T (tokens x vocab, fp32), log_softmax, gather (what a plain forward does)
- gspo: gspo.models.lmhead.chunked_logprobs (chunks of 128 MiB of logits, recomputed in the backward
  pass beyond 512 MiB; never tokens x vocab at once)

Log-probs and gradients of the two paths are equal to 1e-5 (tests/test_lmhead.py).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import ROOT, peak_rss_mb


def worker(args) -> None:
    import torch

    from gspo.algo.losses import policy_loss
    from gspo.config import Loss
    from gspo.models.lmhead import chunked_logprobs

    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    N, H, V, T = args.tokens, args.hidden, args.vocab, args.seq_len
    # made in place: a transient second copy would raise the peak-RSS baseline and hide allocations
    hidden = torch.randn(N, H, generator=g).mul_(0.5).requires_grad_()
    weight = torch.randn(V, H, generator=g).mul_(0.02).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    adv = torch.randn(N // T, generator=g)
    mask = torch.ones(N // T, T)
    base = peak_rss_mb()
    t = time.perf_counter()
    if args.path == "full":
        logits = (hidden @ weight.T).float()  # (N, V)
        logp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)  # (N,)
    else:
        logp = chunked_logprobs(hidden, weight, targets)  # (N,)
    logp = logp.view(N // T, T)
    loss, _ = policy_loss(logp, logp.detach() - 1e-4, adv, mask, Loss(algorithm="gspo", clip_low=3e-4, clip_high=4e-4))
    loss.backward()
    seconds = time.perf_counter() - t
    print("RESULT " + json.dumps({"growth_mb": peak_rss_mb() - base, "seconds": seconds,
                                  "grad_w_norm": float(weight.grad.norm()), "logp_sum": float(logp.sum())}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--path", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.path:
        return worker(args)
    full_gb = args.tokens * args.vocab * 4 / 2**30
    print(f"{args.tokens} tokens x {args.vocab} vocabulary (hidden {args.hidden}): full fp32 logits alone are "
          f"{full_gb:.2f} GiB\n")
    print("| path | peak memory growth (MiB) | time (s) | share of full |")
    print("| --- | --- | --- | --- |")
    res = {}
    for path in ("gspo", "full"):
        cmd = [sys.executable, __file__, "--path", path] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                           vars(args).items() if k not in ("path",)]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT / "benchmarks")
        line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
        if not line:
            raise SystemExit(f"{path} failed:\n{out.stderr[-2000:]}")
        res[path] = json.loads(line[0][7:])
    for path in ("gspo", "full"):
        r = res[path]
        print(f"| {path} | {r['growth_mb']:.0f} | {r['seconds']:.1f} | "
              f"{100 * r['growth_mb'] / res['full']['growth_mb']:.1f}% |")
    same = abs(res["gspo"]["logp_sum"] - res["full"]["logp_sum"]) <= 1e-5 * abs(res["full"]["logp_sum"])
    print(f"\nsame log-probs (sum, rel 1e-5): {same}; |grad W|: gspo {res['gspo']['grad_w_norm']:.6g}, "
          f"full {res['full']['grad_w_norm']:.6g}")


if __name__ == "__main__":
    main()
