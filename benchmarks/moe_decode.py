"""The decode step on an MoE model: Hugging Face's forward against gspo's compact step.

    python benchmarks/moe_decode.py                  # tiny-long-moe, ~15 s on 2 quiet CPU cores
    python benchmarks/moe_decode.py --variants       # + the compact step's MoE MLP computed three ways

Two figures, both on the built-in tiny-long-moe (4 layers, 8 experts of 384, top-2), fp32,
torch.set_num_threads(2):

- one decode step at B = 64 rows (8 chain prompts x 8 samples): median of `--steps` steps after
  10 warm-up steps (the compact decoder's first step, computed both ways for its check, is
  among them), the same tokens fed to both decoders;
- one rollout as the `length` preset samples it (gspo.lab.compare): 8 chain-task prompts x group 8,
  max_new_tokens 240 (the chain task's), temperature 1, routing recorded (gspo.models.moe.Routing, as
  a run with sampling-time log-probs does); the two decoders alternate `--repeats` times after
  a warm-up, the same seed each time (so the same tokens), median wall time.

`--variants` times the compact step with its sparse blocks computed as (a) the model's own
block module, `layer.mlp(h[:, None])`, (b) the router module then the model's experts module,
(c) the router module then gspo.models.fastmoe's grouped experts (what the compact step does).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gspo.models import fastmoe
from gspo.models.loading import load_policy
from gspo.models.moe import Routing
from gspo.models.sequences import left_pad, position_ids_from_mask
from gspo.sampling import fastdecode
from gspo.sampling.rollout import generate, sample_token, sampling_params
from gspo.tasks import get_task

PROMPTS, GROUP, MAX_NEW = 8, 8, 240


def step_median(model, prompts, make, steps: int) -> float:
    """Median seconds of one decode step of the decoder `make(model, max_len)`, B = len(prompts) * GROUP."""
    ids, mask = left_pad(prompts, 0, "cpu")
    dec = make(model, ids.shape[1] + steps + 11)
    logits = dec.prefill(ids, mask, position_ids_from_mask(mask)).repeat_interleave(GROUP, 0)
    dec.expand(GROUP)
    B, P = logits.shape[0], ids.shape[1]
    attn = torch.cat([mask.repeat_interleave(GROUP, 0), torch.ones(B, steps + 11, dtype=mask.dtype)], 1)
    pos = position_ids_from_mask(mask)[:, -1].repeat_interleave(GROUP, 0) + 1
    g, times = torch.Generator().manual_seed(0), []
    for t in range(10 + steps):
        tok, _ = sample_token(logits, 1.0, 1.0, torch.rand(B, generator=g))
        start = time.perf_counter()
        logits = dec.step(tok, attn[:, : P + t + 1], pos + t)
        times.append(time.perf_counter() - start)
    return statistics.median(times[10:])


def rollout_seconds(model, prompts, params, hf: bool) -> tuple[float, int]:
    """Wall seconds of one `generate` (routing recorded) and the steps it took."""
    chosen = fastdecode.path
    if hf:
        fastdecode.path = lambda m, n, **kw: ("hf", "benchmark")
    try:
        routing = Routing(model)
        start = time.perf_counter()
        ro = generate(model, prompts, params, generator=torch.Generator().manual_seed(0), routing=routing)
        seconds = time.perf_counter() - start
        routing.remove()
        return seconds, ro.completion_ids.shape[1]
    finally:
        fastdecode.path = chosen


def block_module(block, h):
    return block(h[:, None])[:, 0]


def experts_module(block, h):
    _, gates, chosen = block.gate(h)
    out = block.experts(h, chosen, gates)
    if hasattr(block, "shared_expert"):
        out = out + torch.sigmoid(block.shared_expert_gate(h)) * block.shared_expert(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-long-moe")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, tok = load_policy(args.model)
    prompts = [tok(ex.prompt)["input_ids"] for ex in get_task("chain").test_set(PROMPTS)]
    print(f"{args.model}: decode path {fastdecode.describe(model, 400)}")
    with torch.inference_mode():
        hf = step_median(model, prompts, lambda m, n: fastdecode.HFDecoder(m), args.steps)
        fast = step_median(model, prompts, fastdecode.FastDecoder, args.steps)
        print(f"decode step, B = {PROMPTS * GROUP}: HF forward {hf * 1e3:.2f} ms, compact {fast * 1e3:.2f} ms "
              f"({hf / fast:.2f}x)")
        if args.variants:
            own = fastmoe.sparse_moe
            for name, fn in (("block module", block_module), ("router + experts module", experts_module),
                             ("router + gspo.models.fastmoe experts", own)):
                fastmoe.sparse_moe = fn
                t = step_median(model, prompts, fastdecode.FastDecoder, args.steps)
                print(f"  compact step, MoE MLP as {name}: {t * 1e3:.2f} ms")
            fastmoe.sparse_moe = own
    params = sampling_params(tok, group_size=GROUP, max_new_tokens=MAX_NEW)
    rollout_seconds(model, prompts, params, hf=False)  # warm-up
    times = {"hf": [], "fast": []}
    for _ in range(args.repeats):
        for side in times:
            seconds, steps = rollout_seconds(model, prompts, params, hf=side == "hf")
            times[side].append(round(seconds, 3))
    hf, fast = statistics.median(times["hf"]), statistics.median(times["fast"])
    print(f"rollout ({PROMPTS} prompts x {GROUP}, max_new_tokens {MAX_NEW}, {steps} steps, routing recorded): "
          f"HF forward {hf:.2f} s, compact {fast:.2f} s ({hf / fast:.2f}x); all: {times}")


if __name__ == "__main__":
    main()
