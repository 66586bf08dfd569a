"""Loading policies: any local Hugging Face causal LM, or a built-in tiny model by name.

    from gspo.models import load_policy
    model, tokenizer = load_policy("tiny")            # the built-in, shipped with the package
    model, tokenizer = load_policy("/path/to/hf/dir")  # anything AutoModelForCausalLM loads

The built-in models live in `gspo/assets/<name>/` as ordinary `save_pretrained` folders and
are loaded with the same `from_pretrained` code as a user's model. They are produced by
`scripts/make_tiny_model.py` (a short supervised warm-start on the arithmetic task, from a
fixed seed), so they start partially competent: rewards vary within a group, which is what
group-relative advantages need. Nothing is ever fetched from a hub.

Left out: quantisation and multi-device placement.
"""

from __future__ import annotations

from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets"
BUILTIN_MODELS = {"tiny": ASSETS / "tiny"}

# one token per character; the vocabulary covers every built-in task
CHARS = "0123456789+-*=() "
SPECIAL = ("<pad>", "<eos>", "<unk>")


def build_char_tokenizer():
    """A character-level tokenizer made locally with the `tokenizers` library."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    for c in CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def tiny_config(vocab_size: int, **overrides):
    """The built-in dense model's architecture: a 4-layer Qwen3 of about 0.8M parameters."""
    from transformers import Qwen3Config

    kw = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path in BUILTIN_MODELS:
        path = BUILTIN_MODELS[name_or_path]
        if not (path / "config.json").exists():
            raise FileNotFoundError(
                f"built-in model {name_or_path!r} is missing from {path}; run scripts/make_tiny_model.py"
            )
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        valid = ", ".join(BUILTIN_MODELS)
        raise FileNotFoundError(f"model {name_or_path!r}: no such directory (built-in models: {valid})")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model {path}: no config.json, not a Hugging Face model directory")
    return path


def load_policy(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Load a causal LM and its tokenizer with `from_pretrained`; returns (model, tokenizer)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    return model, tokenizer
