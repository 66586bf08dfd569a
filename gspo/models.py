"""Loading policies: any local Hugging Face causal LM, or a built-in tiny model by name.

    from gspo.models import load_policy
    model, tokenizer = load_policy("tiny")                     # the built-in, shipped with gspo
    model, tokenizer = load_policy("/path/to/hf/dir", dtype=torch.bfloat16)
    model, tokenizer = load_policy("runs/x/checkpoints/step-000060")   # full model or LoRA adapter

The built-in models live in `gspo/assets/<name>/` as ordinary `save_pretrained` folders and
are loaded with the same `from_pretrained` code as a user's model. They are produced by
`scripts/make_tiny_model.py` (a short supervised warm-start on the arithmetic task, from a
fixed seed; `tiny-long` and `tiny-long-moe`, for the long-answer `chain` task, by
`scripts/make_long_model.py`), so they start partially competent: rewards vary within a group, which is what
group-relative advantages need. Nothing is ever fetched from a hub (`local_files_only`).

A directory holding a PEFT LoRA adapter (`adapter_config.json`) is loaded as its base model
plus the adapter. `add_lora` wraps a model for LoRA training.

Left out: quantisation and multi-device placement (see the distributed issue).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ASSETS = Path(__file__).parent / "assets"
BUILTIN_MODELS = {"tiny": ASSETS / "tiny", "tiny-moe": ASSETS / "tiny-moe",
                  # for the long-answer `chain` task (scripts/make_long_model.py)
                  "tiny-long": ASSETS / "tiny-long", "tiny-long-moe": ASSETS / "tiny-long-moe",
                  # a chat model that calls tools, for the multi-turn `calculator` task (scripts/make_tool_model.py)
                  "tiny-tool": ASSETS / "tiny-tool"}

# one token per character; the vocabulary covers every built-in task
CHARS = "0123456789+-*=() "
SPECIAL = ("<pad>", "<eos>", "<unk>")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# the chat model's tokenizer (`build_chat_tokenizer`): characters, plus the chat markers of
# Qwen2.5-style templates (the turn markers are special tokens, the tool-call ones are not: a
# tool call must survive decoding with special tokens skipped, as in Qwen's own tokenizer)
CHAT_CHARS = CHARS + "/abcdefghijklmnopqrstuvwxyz{}\":,_.\n"
CHAT_SPECIAL = ("<pad>", "<|im_end|>", "<unk>", "<|im_start|>")
CHAT_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# Hermes-style tool calls (Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
# tools are listed in a system turn by name and parameters (the tiny model has no room for schemas)
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.function.name }}("
    "{{ t.function.parameters.properties | list | join(', ') }}){% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for call in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>tool\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelError(ValueError):
    """A model path that cannot be trained; the message is one line naming it."""


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


def build_chat_tokenizer():
    """The chat model's tokenizer (`tiny-tool`): one token per character of CHAT_CHARS, the chat
    markers as single tokens, `<|im_end|>` as EOS, and CHAT_TEMPLATE as its chat template."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(CHAT_SPECIAL + CHAT_MARKERS)}
    for c in CHAT_CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in CHAT_SPECIAL])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in CHAT_MARKERS])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", unk_token="<unk>",
                                  additional_special_tokens=["<|im_start|>"])
    out.chat_template = CHAT_TEMPLATE
    return out


# the trunk both built-in models share (the MoE model replaces each MLP with experts)
_TINY_TRUNK = dict(
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


def tiny_config(vocab_size: int, **overrides):
    """The built-in dense model's architecture: a 4-layer Qwen3 of about 0.8M parameters."""
    from transformers import Qwen3Config

    return Qwen3Config(**{"vocab_size": vocab_size, **_TINY_TRUNK, **overrides})


def tiny_moe_config(vocab_size: int, **overrides):
    """The built-in MoE model: a 4-layer Qwen3-MoE, 8 experts, top-2 (about 2.6M parameters,
    0.8M active per token, like the dense tiny model)."""
    from transformers import Qwen3MoeConfig

    experts = dict(moe_intermediate_size=192, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                   decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.01)
    return Qwen3MoeConfig(**{"vocab_size": vocab_size, **_TINY_TRUNK, **experts, **overrides})


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; anything else as given (checked)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(f"device {device!r}: CUDA is not available on this machine (use --device cpu or auto)")
    if dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
        raise ModelError(f"device {device!r}: Apple's MPS is not available on this machine (use --device cpu or auto)")
    return dev


def resolve_model_path(name_or_path: str) -> Path:
    if name_or_path in BUILTIN_MODELS:
        path = BUILTIN_MODELS[name_or_path]
        if not (path / "config.json").exists():
            script = "make_long_model.py" if "long" in name_or_path else \
                "make_tool_model.py" if "tool" in name_or_path else "make_tiny_model.py"
            raise ModelError(f"built-in model {name_or_path!r} is missing from {path}; run scripts/{script}")
        return path
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        valid = ", ".join(BUILTIN_MODELS)
        raise ModelError(f"model {name_or_path}: no such directory (built-in models: {valid})")
    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        raise ModelError(f"model {path}: no config.json, not a Hugging Face model directory")
    return path


def check_causal_lm(path: Path) -> None:
    """Fail with one line unless `path` holds a config AutoModelForCausalLM can build."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"model {path}: config.json is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelError(f"model {path}: config.json has no 'model_type'; not a Hugging Face model")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"model {path}: model_type {model_type!r} is not a causal language model "
                         "(AutoModelForCausalLM cannot load it)")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelError(f"model {path}: cannot read its config ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelError(f"model {path}: cannot load its tokenizer ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    return prepare_tokenizer(tokenizer, f"model {path}")


def prepare_tokenizer(tokenizer, where: str):
    """A tokenizer gspo can sample with: it must have an EOS token; padding defaults to it."""
    if tokenizer is None:
        raise ModelError(f"{where}: required with a model object (pass tokenizer=)")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ModelError(f"{where}: the tokenizer has no EOS token; completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                base_model: str | None = None, trainable_adapter: bool = False):
    """Load a causal LM (or base model + LoRA adapter) and its tokenizer; returns (model, tokenizer).

    base_model: for an adapter directory, the base to load it onto (default: the adapter's
    recorded base_model_name_or_path).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path(name_or_path)
    if (path / "adapter_config.json").exists():
        PeftModel = _peft(f"model {path} (a LoRA adapter)").PeftModel

        base_name = base_model or json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        if not base_name:
            raise ModelError(f"model {path}: LoRA adapter without a recorded base model; pass the base with --model")
        base, _ = load_policy(base_name, dtype=dtype, device=device)
        tokenizer = load_tokenizer(path if (path / "tokenizer_config.json").exists() else resolve_model_path(base_name))
        model = PeftModel.from_pretrained(base, path, is_trainable=trainable_adapter).to(device)
        return model, tokenizer
    check_causal_lm(path)
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    return model, tokenizer


def _peft(what: str):
    """The peft module, or a one-line error naming the install command."""
    try:
        import peft
    except ImportError:
        raise ModelError(f"{what} needs the peft package: pip install 'gspo[lora]'") from None
    return peft


def add_lora(model, *, r: int, alpha: float, dropout: float, target_modules: list[str]):
    """Wrap `model` with trainable LoRA adapters (PEFT); the base weights are frozen."""
    peft = _peft("--lora-r")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    targets = target_modules[0] if list(target_modules) == ["all-linear"] else list(target_modules)
    try:
        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
        return get_peft_model(model, cfg)
    except ValueError as e:
        raise ModelError(f"lora_target_modules {list(target_modules)}: {' '.join(str(e).split())[:200]}") from None


def unwrap(model):
    """The underlying transformers model of a PEFT wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def low_precision_copy(model, dtype: torch.dtype):
    """A copy of `model` with its parameters in `dtype`, made the way a loader (or an inference
    engine) makes one: buffers such as RoPE's `inv_freq` stay as they are (float32). Casting
    the whole model would round inv_freq to bf16: a position error of 0.6 rad at 512 and
    4.7 rad at 4096 tokens, a precision gap no inference engine has."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.data = p.data.to(dtype)
    return out


_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                        "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout")


def disable_dropout(model) -> None:
    """Dropout off everywhere (nn.Dropout modules, LoRA's included, and the config values
    attention kernels read), so a training forward computes the same log-probs as the no-grad
    passes of the old policy: the first minibatch's ratios are exactly 1 (as verl and TRL do)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for holder in (m, getattr(m, "config", None)):  # attention modules copy the config's value
            for key in _DROPOUT_KEYS:
                if isinstance(getattr(holder, key, None), float):
                    setattr(holder, key, 0.0)
