"""Milliseconds per decode step on a GPU: eager launches against the step captured in a CUDA graph.

    python benchmarks/decode_graphs.py --model runs/gpu-check/qwen-shaped          # on a CUDA machine
    python benchmarks/decode_graphs.py --model runs/gpu-check/qwen-shaped --device cpu --rows 16 --steps 8

`scripts/gpu_check.sh` runs it (stage `decode`) on the Qwen2.5-0.5B-shaped model it builds. One
rollout batch (`--rows` rows: `--rows / 8` prompts x 8 samples, `--prompt-tokens` each), prefilled
once per decoder, then `--steps` decode steps fed random tokens; the median ms of a step after
the first (the first is the rollout's check, computed both ways, and, in graphs, the capture),
the decoders alternating `--repeats` times:
- `fast eager`: gspo's hand-written step (gspo.sampling.fastdecode), launched from Python: what a
  GPU run decoded with before CUDA graphs (docs/gpu.md: ~20 ms a step at 256 rows on an H100);
- `layers eager`: the model's own layers over gspo's cache (gspo.sampling.layerdecode), eagerly;
- `layers static`: the same in static mode (a bucket's rows, the cache's whole width), eagerly:
  the code a graph captures;
- `graphs`: static mode with the step captured in a CUDA graph and replayed (gspo.sampling.graphs);
  the capture's own seconds are printed beside it.
On the CPU there is no `graphs` row. Also printed: the largest difference between the graph's
logits and the eager static step's on the same inputs (they must agree to the rollout check's
tolerance), and the peak GPU memory of each. The issue's target: 5 ms or less at 256 rows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import ROOT  # noqa: F401  (gspo importable from the checkout)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(make, model, rows: int, prompt_tokens: int, steps: int, vocab: int) -> dict:
    """One rollout's decode steps with the decoder `make()` makes: median ms a step, capture seconds, peak memory."""
    device = next(model.parameters()).device
    G = 8 if rows % 8 == 0 else 1
    N = rows // G
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (N, prompt_tokens), generator=g).to(device)
    mask = torch.ones_like(ids)
    pos = torch.arange(prompt_tokens, device=device)[None].repeat(N, 1)
    attn = torch.ones((rows, prompt_tokens + steps), dtype=mask.dtype, device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, logits = [], []
    with torch.inference_mode():
        dec = make()
        dec.prefill(ids, mask, pos)
        dec.expand(G)
        nxt = torch.full((rows,), prompt_tokens, device=device)
        for s in range(steps):
            tok = torch.randint(3, vocab, (rows,), generator=g).to(device)
            sync(device)
            t0 = time.perf_counter()
            out = dec.step(tok, attn[:, :prompt_tokens + s + 1], nxt)
            sync(device)
            times.append(time.perf_counter() - t0)
            if s < 3:
                logits.append(out.float().cpu())
            nxt = nxt + 1
    assert not getattr(dec, "fallback", False), f"{type(dec).__name__} fell back to Hugging Face's forward"
    runner = getattr(dec, "graphs", None)
    return {"ms": 1e3 * statistics.median(times[1:]), "first_s": times[0], "logits": logits,
            "off": bool(runner is not None and runner.off),
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory (scripts/make_qwen_shaped.py makes one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (--device cpu)")
    ap.add_argument("--out", default=None, help="also write the table to this Markdown file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from gspo.sampling import fastdecode as fd
    from gspo.sampling import graphs
    from gspo.sampling.layerdecode import LayerDecoder

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype) if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    max_len = args.prompt_tokens + args.steps
    vocab = model.config.vocab_size
    makers = {"layers eager": lambda: LayerDecoder(model, max_len),
              "layers static": lambda: LayerDecoder(model, max_len, static=True)}
    if fd.unsupported_compact(model, max_len) is None:
        makers = {"fast eager": lambda: fd.FastDecoder(model, max_len), **makers}
    why = graphs.why_not(model)
    if why is None:
        makers["graphs"] = lambda: LayerDecoder(model, max_len, static=True, graphs=graphs.Runner())
    res = {k: [] for k in makers}
    for _ in range(args.repeats):
        for k, make in makers.items():
            res[k].append(run(make, model, args.rows, args.prompt_tokens, args.steps, vocab))
    params = sum(p.numel() for p in model.parameters())
    lines = [f"{params / 1e6:.0f}M parameters, {str(dtype).removeprefix('torch.')}, {args.rows} rows, "
             f"{args.prompt_tokens} prompt tokens, {args.steps} decode steps, {device}"
             + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
             + ("" if why is None else f"; no CUDA graphs: {why}"), "",
             "| decoder | median ms a step | first step (s) | peak GPU memory (GiB) |", "| --- | --- | --- | --- |"]
    for k, rs in res.items():
        ms = statistics.median(r["ms"] for r in rs)
        first = statistics.median(r["first_s"] for r in rs)
        off = " (graphs turned themselves off: see the warning)" if any(r["off"] for r in rs) else ""
        lines.append(f"| {k}{off} | {ms:.2f} | {first:.3f} | {max(r['peak_gib'] for r in rs):.2f} |")
    if "graphs" in res:
        ref, got = res["layers static"][0]["logits"], res["graphs"][0]["logits"]
        diff = max(float((a - b).abs().max()) for a, b in zip(ref, got))
        lines += ["", f"graph replay against the eager static step, first 3 steps: max |logit difference| {diff:.3g}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
