"""Where the mid-size model's update goes, operator by operator (torch.profiler), and what bounds it.

    python benchmarks/update_profile.py                  # ~2 min on 2 CPU cores
    python benchmarks/update_profile.py --threads 1 --top 25

One rollout batch of benchmarks/vs_trl.py's mid configuration (4 prompts x 8 completions x 128 tokens,
fp32, 4 minibatches; benchmarks/update_parts.py builds it), one warm-up update, then one update under
torch.profiler: the operators' own CPU time (self time, children excluded), summed by name, the top
`--top` printed with their share of the update and, for the matmuls, the GFLOP/s they ran at. Below the
table: the update's model FLOPs (6 x params x trained tokens) over its time as a share of the measured
fp32 matmul peak, the matmuls' share of the time, and what the rest is (elementwise passes over
activations, bounded by memory bandwidth, which `--bandwidth` measures: a 256 MiB read).
Printed, not asserted: the figures are docs/performance.md's.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from update_parts import build
from vs_trl import matmul_peak

MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
           "aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def update_once(run, batch) -> None:
    """The trainer's own update of `batch` (every minibatch's forward, backward and optimizer step)."""
    from gspo.train import trainer

    trainer.update(run, batch, torch.Generator().manual_seed(0))


def bandwidth_gbs() -> float:
    x = torch.ones(64 * 2**20)  # 256 MiB
    x.sum()
    t = time.perf_counter()
    for _ in range(5):
        x.sum()
    return 5 * x.numel() * 4 / (time.perf_counter() - t) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from gspo.train.trainer import train_step

    peak = matmul_peak(args.threads)
    from gspo.processes.memory import keep_large_on_heap

    print(keep_large_on_heap(True))  # as gspo train does (--malloc-heap)
    run = build(args.threads)
    _, batch = train_step(run, 1)
    update_once(run, batch)  # warm-up
    t = time.perf_counter()
    update_once(run, batch)
    plain = time.perf_counter() - t
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_flops=True) as prof:
        t = time.perf_counter()
        update_once(run, batch)
        traced = time.perf_counter() - t
    own = defaultdict(float)
    flops = defaultdict(float)
    for e in prof.key_averages():
        own[e.key] += e.self_cpu_time_total / 1e6
        flops[e.key] += e.flops or 0
    total = sum(own.values())
    params = sum(p.numel() for p in run.policy.parameters())
    tokens = int(batch.rollout.attention_mask.sum())
    gflop = 6 * params * tokens / 1e9
    print(f"machine: {args.threads} threads, fp32 matmul peak {peak:.0f} GFLOP/s, read bandwidth "
          f"{bandwidth_gbs():.1f} GB/s (256 MiB)")
    print(f"update: {plain:.2f} s ({traced:.2f} s traced); model FLOPs {gflop:.0f} GFLOP: "
          f"{gflop / plain:.1f} GFLOP/s, {100 * gflop / plain / peak:.1f}% of the matmul peak\n")
    print("| operator | own seconds | share | GFLOP/s |")
    print("| --- | --- | --- | --- |")
    for key, sec in sorted(own.items(), key=lambda kv: -kv[1])[:args.top]:
        rate = f"{flops[key] / sec / 1e9:.0f}" if flops[key] and sec else ""
        print(f"| `{key}` | {sec:.2f} | {100 * sec / total:.1f}% | {rate} |")
    mm = sum(sec for key, sec in own.items() if key in MATMULS)
    print(f"\nmatmuls and attention kernels: {mm:.2f} s of {total:.2f} s operator time ({100 * mm / total:.0f}%); "
          f"the rest ({total - mm:.2f} s) is elementwise passes, reductions, copies and the optimizer")


if __name__ == "__main__":
    main()
