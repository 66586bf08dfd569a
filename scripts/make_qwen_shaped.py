"""Build a randomly initialised model with Qwen2.5-0.5B's shapes, offline, for speed and memory checks.

    python scripts/make_qwen_shaped.py runs/qwen-shaped                    # 24 layers, hidden 896: ~0.5B
    python scripts/make_qwen_shaped.py /tmp/q --layers 2 --hidden 64 --heads 4 --kv-heads 2 \
        --intermediate 128 --vocab 1024                                     # a tiny one, for a CPU test

What it makes. A `Qwen2ForCausalLM` from a `Qwen2Config` with the shapes of Qwen/Qwen2.5-0.5B
(24 layers, hidden 896, 14 query heads and 2 key/value heads of 64, MLP 4864, vocabulary
151,936, tied embeddings, RoPE θ 1e6, 32,768 positions) and random weights, saved with
`save_pretrained`, next to a tokenizer built with the `tokenizers` library: one token per
character, Qwen's chat markers (`<|im_start|>`, `<|im_end|>` as EOS, `<|endoftext|>` as pad),
a Qwen-style chat template, and filler tokens `<tN>` up to the vocabulary size, so that every
id a random model samples decodes. Nothing is downloaded: `scripts/gpu_check.sh` runs on GPU
machines that cannot reach the Hugging Face Hub. Every size is a flag, so a test builds a tiny one.

What it leaves out: Qwen's byte-level BPE tokenizer and any trained weight. The model does not
learn anything worth measuring; what it is for is the cost of a step (time, memory) and the gap
between the sampler's and the trainer's log-probs at the real model's shapes.

`even_token_share` is the reward the check trains with: a random model almost never samples EOS,
so every completion runs to --max-new-tokens and a length reward would be flat in every group
(all advantages 0). The share of even token ids varies from sample to sample, so groups have signal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

QWEN25_05B = dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936, max_positions=32768)
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<unk>"]  # ids 0, 1, 2: pad, EOS, unknown
MARKERS = ["<|im_start|>"]
CHARS = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def even_token_share(completions, completion_ids=None, **_):
    """Reward: the share of a completion's token ids that are even (a signal random weights vary).

    >>> even_token_share(["", "", ""], completion_ids=[[2, 4, 5, 7], [1], []])
    [0.5, 0.0, 0.0]
    """
    return [sum(i % 2 == 0 for i in ids) / max(len(ids), 1) for ids in completion_ids]


def build_tokenizer(vocab_size: int):
    """Characters, Qwen's chat markers and filler tokens `<tN>`: exactly `vocab_size` tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    base = SPECIAL + MARKERS + CHARS
    if vocab_size < len(base):
        raise SystemExit(f"--vocab must be at least {len(base)} (the special tokens and characters)")
    vocab = {tok: i for i, tok in enumerate(base)}
    for i in range(len(base), vocab_size):
        vocab[f"<t{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in MARKERS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
                                  unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    out.chat_template = CHAT_TEMPLATE
    return out


def qwen2_config(*, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                 max_positions: int):
    """A Qwen2Config with these shapes and Qwen2.5's other settings (RoPE θ 1e6, tied embeddings)."""
    from transformers import Qwen2Config

    if hidden % heads or heads % kv_heads:
        raise SystemExit(f"--hidden {hidden} must be a multiple of --heads {heads}, "
                         f"and --heads of --kv-heads {kv_heads}")
    return Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
                       pad_token_id=0, eos_token_id=1, bos_token_id=None)


def build(out: Path, *, layers: int, hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
          max_positions: int, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write the model and tokenizer to `out`; returns `out`."""
    import torch
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer(vocab)
    cfg = qwen2_config(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                       vocab=vocab, max_positions=max_positions)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.safetensors"):
        stale.unlink()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    (out / "qwen_shaped.json").write_text(json.dumps({"parameters": n, "layers": layers, "hidden": hidden,
                                                      "vocab": vocab, "dtype": dtype}) + "\n")
    print(f"make_qwen_shaped: {n / 1e6:.1f}M parameters ({layers} layers, hidden {hidden}, vocab {vocab}, "
          f"{dtype}) written to {out}")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="directory to write the model and tokenizer to")
    for name, default in QWEN25_05B.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=default,
                        help=f"default {default} (Qwen2.5-0.5B)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="dtype of the saved weights (Qwen2.5 ships bfloat16)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    build(args.out, **{k: v for k, v in vars(args).items() if k != "out"})


if __name__ == "__main__":
    main()
