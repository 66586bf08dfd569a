"""Extra peak memory of one vLLM weight sync: the whole state dict (before) against one tensor at a time.

    python benchmarks/weight_sync.py                 # Qwen2.5-1.5B width, 2 layers, fp32 policy, bf16 engine
    python benchmarks/weight_sync.py --layers 8      # the streamed peak does not grow with depth

A Qwen2.5-1.5B-width model built from its configuration (Qwen2Config: hidden 1536, MLP 8960,
12 query and 2 key-value heads, vocabulary 151,936, tied embeddings), random float32 weights
(the master weights), with `--layers` decoder layers (default 2) instead of 28 so that the FSDP case fits
this machine's shared memory; the "before" figures for 28 layers are then computed from the
tensor sizes (the whole dict holds one copy of every gathered or merged weight). Three cases:

- plain: the model as it is;
- lora: PEFT LoRA (r 16) on every linear layer, merged for the engine;
- fsdp: FSDP2 over two processes (gloo), every parameter a DTensor sharded in two; the
  figures are rank 0's (each process gathers every whole parameter).

Each case runs in a fresh process. A stand-in engine consumes the pairs as vLLM's
`reload_weights` does (a for loop over the iterator, each tensor copied into the engine's
bfloat16 weights, which exist before the measurement starts). Two figures: the peak resident
memory during the sync minus the resident memory before it (the kernel's high-water mark,
reset first through /proc/self/clear_refs), and the most bytes of made tensors (gathered,
merged or cast: not the parameters themselves) alive at once, tracked through weak references
at each pair. Left out: vLLM's own reload memory (its layerwise reload builds each layer anew
before copying it into place: one layer's size, the same before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import weakref
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

SHAPE = dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12, num_key_value_heads=2,
             vocab_size=151_936, tie_word_embeddings=True, max_position_embeddings=4096)
MIB = 2**20


def whole_state_dict(policy):
    """How gspo built the weights for a sync before streaming: every one at once."""
    from gspo.models.loading import unwrap

    model = unwrap(policy)
    lora = {name: m for name, m in model.named_modules() if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer")}
    out = {}
    for name, value in model.state_dict().items():
        if "lora_" in name:
            continue
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        module = name.rsplit(".", 1)[0].removesuffix(".base_layer")
        if name.endswith(".base_layer.weight") and module in lora:
            with torch.no_grad():
                value = value + lora[module].get_delta_weight("default").to(value.dtype)
        out[re.sub(r"\.base_layer(?=\.)", "", name)] = value.detach()
    return iter(out.items())


def rss_mib(field: str = "VmRSS") -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def build(case: str, layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **SHAPE))
    model = model.to_empty(device="cpu").float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    if case == "lora":
        from gspo.models.loading import add_lora

        model = add_lora(model, r=16, alpha=32, dropout=0.0, target_modules=["all-linear"])
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.01)
    if case == "fsdp":
        import torch.distributed as td
        from torch.distributed.device_mesh import init_device_mesh

        from gspo.processes.distributed import Dist
        from gspo.processes.parallel import wrap

        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        td.init_process_group("gloo", rank=rank, world_size=world)
        wrap(model, Dist(rank=rank, world=world, parallel="fsdp", mesh=init_device_mesh("cpu", (world,))))
    return model


def child(args) -> None:
    from gspo.models.loading import unwrap
    from gspo.sampling.vllm_engine import checkpoint_weights

    torch.set_num_threads(args.threads)
    model = build(args.case, args.layers)
    params = {p.to_local().data_ptr() if hasattr(p, "to_local") else p.data_ptr() for p in unwrap(model).parameters()}
    engine = {name: torch.zeros(t.shape, dtype=torch.bfloat16) for name, t in checkpoint_weights(model, torch.bfloat16)}
    largest = max(t.numel() for t in engine.values())
    open("/proc/self/clear_refs", "w").write("5")  # the high-water mark from here
    base = rss_mib()
    pairs = whole_state_dict(model) if args.side == "before" else checkpoint_weights(model, torch.bfloat16)
    refs, held = [], 0
    for name, t in pairs:  # the stand-in engine: vLLM's loader loop
        if t.data_ptr() not in params:
            refs.append((weakref.ref(t), t.numel() * t.element_size()))
        held = max(held, sum(n for r, n in refs if r() is not None))
        engine[name].copy_(t)  # (vLLM: into the layer it builds anew, then into place)
    del t, pairs
    print(json.dumps({"peak_mib": rss_mib("VmHWM") - base, "held_mib": held / MIB,
                      "largest_fp32_mib": largest * 4 / MIB, "n_params": sum(v.numel() for v in engine.values())}))


def run(args, case: str, side: str, layers: int) -> dict:
    """One case in a fresh process (fsdp: two, one per shard; rank 0's figures)."""
    cmd = [sys.executable, __file__, "--child", "--case", case, "--side", side, "--layers", str(layers),
           "--threads", str(args.threads)]
    world = 2 if case == "fsdp" else 1
    env = {**os.environ, "PYTHONPATH": str(HERE.parent), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(29500 + os.getpid() % 1000)}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**env, "RANK": str(r)}) for r in range(world)]
    outs = [p.communicate() for p in procs]
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("{")]
    if any(p.returncode for p in procs) or not lines:
        raise SystemExit(f"{case}/{side}: {outs[0][1].strip()[-800:]}")
    return json.loads(lines[-1])


def made_bytes_28_layers(case: str) -> float:
    """What the whole dict holds for the 28-layer model: every gathered (fsdp) or merged (lora) weight."""
    h, i, kv, v = 1536, 8960, 2 * 128, 151_936
    layer_linear = h * h * 2 + h * kv * 2 + 3 * h * i  # q, o; k, v; gate, up, down
    layer_all = layer_linear + (h + 2 * kv) + 2 * h  # + q, k, v biases and two norms
    if case == "lora":
        return 28 * layer_linear * 4
    if case == "fsdp":
        return (28 * layer_all + v * h * 2 + h) * 4  # the tied head gathered a second time, the final norm
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--cases", default="plain,lora,fsdp")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--case", default="plain", help=argparse.SUPPRESS)
    ap.add_argument("--side", default="after", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    print(f"Qwen2.5-1.5B width, {args.layers} layers, float32 policy -> bfloat16 engine; extra memory of one sync")
    print("| case | side | peak RSS growth | made tensors held at once | / largest parameter (fp32) | "
          "before, 28 layers (sizes) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case in args.cases.split(","):
        for side in ("before", "after"):
            r = run(args, case, side, args.layers)
            big = r["largest_fp32_mib"]
            est = f"{made_bytes_28_layers(case) / MIB:,.0f} MiB" if side == "before" else ""
            print(f"| {case} | {side} | {r['peak_mib']:,.0f} MiB | {r['held_mib']:,.0f} MiB | "
                  f"{r['peak_mib'] / big:.2f}x of {big:,.0f} MiB | {est} |", flush=True)


if __name__ == "__main__":
    main()
