"""Loading policies: a Hugging Face causal LM by Hub id or directory, or a built-in tiny model by name.

    from gspo.models.loading import load_policy
    model, tokenizer = load_policy("tiny")                     # the built-in, shipped with gspo
    model, tokenizer = load_policy("/path/to/hf/dir", dtype=torch.bfloat16)
    model, tokenizer = load_policy("Qwen/Qwen2.5-0.5B-Instruct", revision="main")   # a Hub id
    model, tokenizer = load_policy("runs/x/checkpoints/step-000060")   # full model or LoRA adapter
    model, tokenizer = load_policy("runs/x/checkpoints/step-000060", adapter=AdapterLoad("my/base", trainable=True))

The built-in models live in `gspo/assets/<name>/` as ordinary `save_pretrained` folders and
are loaded with the same `from_pretrained` code as a user's model. They are produced by
`scripts/make_tiny_model.py` (a short supervised warm-start on the arithmetic task, from a
fixed seed; `tiny-long` and `tiny-long-moe`, for the long-answer `chain` task, by
`scripts/make_long_model.py`), so they start partially competent: rewards vary within a group, which is what
group-relative advantages need.

A name that is not a built-in nor an existing directory but reads as a Hub id (`ORG/NAME`) is
resolved to its local snapshot directory by gspo.io.hub (downloaded once, with only the files a
model needs; read from the cache under HF_HOME with `HF_HUB_OFFLINE=1`; `revision` picks a
branch, tag or commit). From there on everything reads a directory (`local_files_only`), and
the model keeps the id as its `name_or_path`, so a LoRA adapter records the id as its base.

A directory holding a PEFT LoRA adapter (`adapter_config.json`) is loaded as its base model
(a directory or Hub id, at the adapter's recorded revision) plus the adapter. `add_lora`
wraps a model for LoRA training. Refused in one line: encoder and encoder-decoder models
(BERT, T5, BART: not causal LMs), and directories without tokenizer files.

Left out: quantisation and multi-device placement (see the distributed issue).
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

ASSETS = Path(__file__).parents[1] / "assets"  # gspo/assets
BUILTIN_MODELS = {"tiny": ASSETS / "tiny", "tiny-moe": ASSETS / "tiny-moe",
                  # Qwen3-MoE's fine-grained shape scaled down: 32 experts, top-8 (docs/moe.md, the moe preset)
                  "tiny-moe-wide": ASSETS / "tiny-moe-wide",
                  # for the long-answer `chain` task (scripts/make_long_model.py)
                  "tiny-long": ASSETS / "tiny-long", "tiny-long-moe": ASSETS / "tiny-long-moe",
                  # a chat model that calls tools, for the multi-turn `calculator` task (scripts/make_tool_model.py)
                  "tiny-tool": ASSETS / "tiny-tool"}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# the built-in models' tokenizers and architectures (gspo.models.tiny); imported from here by scripts and tests
from gspo.models.tiny import (  # noqa: E402,F401
    CHARS,
    CHAT_CHARS,
    CHAT_MARKERS,
    CHAT_SPECIAL,
    CHAT_TEMPLATE,
    SPECIAL,
    build_char_tokenizer,
    build_chat_tokenizer,
    tiny_config,
    tiny_moe_config,
)


class ModelError(ValueError):
    """A model path that cannot be trained; the message is one line naming it."""


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


def gguf_dir(path: Path, name: str) -> Path | None:
    """The converted model directory of a .gguf file (or of a directory holding one); None if neither."""
    from gspo.io.reporting import line_on_stderr
    from gspo.models.gguf import converted, gguf_source

    src = gguf_source(path, name)
    return None if src is None else converted(src, log=line_on_stderr)


def gguf_info(path: Path) -> dict | None:
    """What a directory converted from a GGUF file records (gspo.models.gguf); None for any other."""
    from gspo.models.gguf import source_info

    return source_info(path)


def resolve_model_path(name_or_path: str, *, revision: str | None = None) -> Path:
    """The local directory of a model: a built-in's, a local directory, or a Hub id's snapshot
    (gspo.io.hub.model_dir; `revision` applies to Hub ids only). Raises ModelError / HubError."""
    if name_or_path in BUILTIN_MODELS:
        path = BUILTIN_MODELS[name_or_path]
        if not (path / "config.json").exists():
            script = "make_long_model.py" if "long" in name_or_path else \
                "make_tool_model.py" if "tool" in name_or_path else "make_tiny_model.py"
            raise ModelError(f"built-in model {name_or_path!r} is missing from {path}; run scripts/{script}")
        return path
    from gspo.io.hub import HubError, close_to, looks_like_hub_id, model_dir, nearby

    path, valid = Path(name_or_path).expanduser(), ", ".join(BUILTIN_MODELS)
    if path.exists() and (converted := gguf_dir(path, name_or_path)) is not None:  # a .gguf: converted once, cached
        return converted
    if path.exists() and not path.is_dir():
        raise ModelError(f"model {name_or_path}: a file, not a model directory (a Hugging Face model is a directory "
                         "with config.json, or a .gguf file)")
    # a Hub id is only tried for what no local path can be, and not for a near miss of a built-in name
    if not path.is_dir() and looks_like_hub_id(name_or_path) and not close_to(name_or_path, BUILTIN_MODELS):
        try:
            path = model_dir(name_or_path, revision=revision)
        except HubError as e:  # a bare name may be a misspelt built-in
            raise (HubError(f"{e}; nor a local directory (built-in models: {valid})") if "/" not in name_or_path
                   else e) from None
    elif not path.is_dir() and name_or_path.lower().endswith(".gguf"):
        raise ModelError(f"model {name_or_path}: no such file{nearby(name_or_path, files=True)}")
    elif not path.is_dir():
        raise ModelError(f"model {name_or_path}: no such directory{nearby(name_or_path, BUILTIN_MODELS)} "
                         f"(built-in models: {valid})")
    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        raise ModelError(f"model {name_or_path}: no config.json, not a Hugging Face model directory")
    return path


def is_hub_model(name_or_path: str) -> bool:
    """Whether `name_or_path` is loaded from the Hub (not a built-in, not an existing directory)."""
    from gspo.io.hub import close_to, looks_like_hub_id

    return name_or_path not in BUILTIN_MODELS and not Path(name_or_path).expanduser().is_dir() and \
        looks_like_hub_id(name_or_path) and not close_to(name_or_path, BUILTIN_MODELS)


def check_causal_lm(path: Path, name: str | None = None) -> None:
    """Fail with one line (naming `name`, default the path) unless `path` holds a config
    AutoModelForCausalLM can build as a decoder: encoders (BERT, RoBERTa) and encoder-decoder
    models map to a causal-LM class too, but only as a decoder variant (`is_decoder`)."""
    from transformers import AutoConfig
    from transformers.models.auto import modeling_auto as auto

    name = name or str(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelError(f"model {name}: config.json is not valid JSON ({e})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelError(f"model {name}: config.json has no 'model_type'; not a Hugging Face model")
    if model_type not in auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelError(f"model {name}: model_type {model_type!r} is not a causal language model "
                         "(AutoModelForCausalLM cannot load it)")
    seq2seq = model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    if (seq2seq or model_type in auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES) and not raw.get("is_decoder"):
        kind = "an encoder-decoder (sequence-to-sequence) model" if seq2seq else "an encoder"
        raise ModelError(f"model {name}: model_type {model_type!r} is {kind}, not a causal (decoder) language model")
    try:
        AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelError(f"model {name}: cannot read its config "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


# any of these makes a directory's tokenizer loadable (fast, BPE, WordPiece, SentencePiece, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                   "spiece.model", "sentencepiece.bpe.model", "tokenizer.tiktoken")


def load_tokenizer(path: Path, name: str | None = None):
    """The tokenizer saved in `path` (one line naming `name` when there is none or it fails)."""
    from transformers import AutoTokenizer

    name = name or str(path)
    if not any((Path(path) / f).exists() for f in TOKENIZER_FILES):
        raise ModelError(f"model {name}: no tokenizer files (tokenizer.json / tokenizer_config.json / vocab or "
                         "SentencePiece files); save them with tokenizer.save_pretrained, or pass tokenizer= in Python")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:
        raise ModelError(f"model {name}: cannot load its tokenizer "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    return prepare_tokenizer(tokenizer, f"model {name}")


def prepare_tokenizer(tokenizer, where: str):
    """A tokenizer gspo can sample with: it must have an EOS token; padding defaults to it."""
    if tokenizer is None:
        raise ModelError(f"{where}: required with a model object (pass tokenizer=)")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ModelError(f"{where}: the tokenizer has no EOS token; completions could never end")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass(frozen=True)
class AdapterLoad:
    """How load_policy loads a LoRA adapter directory (ignored for a full model).

    base_model: the base to load it onto (None: the adapter's recorded base_model_name_or_path,
    at load_policy's `revision` or else its recorded revision). trainable: the adapter's weights
    train (resuming a LoRA run), else they are frozen."""

    base_model: str | None = None
    trainable: bool = False


def load_policy(name_or_path: str, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                revision: str | None = None, with_tokenizer: bool = True, adapter: AdapterLoad = AdapterLoad()):
    """Load a causal LM (or base model + LoRA adapter) and its tokenizer; returns (model, tokenizer).

    name_or_path: a built-in name, a directory, or a Hub id (at `revision`).
    with_tokenizer: False returns (model, None) (a tokenizer comes from elsewhere).
    adapter: for an adapter directory, its base and whether it trains (AdapterLoad).
    """
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    path = resolve_model_path(name_or_path, revision=revision)
    hub = is_hub_model(name_or_path)
    name = name_or_path if hub else str(path)
    if (path / "adapter_config.json").exists():
        return _load_adapter(path, name, dtype=dtype, device=device, adapter=adapter,
                             base_revision=None if hub else revision)
    check_causal_lm(path, name)
    tokenizer = load_tokenizer(path, name) if with_tokenizer else None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device)
    if hub:  # as transformers records a model loaded by id (a LoRA adapter then names it as its base)
        model.config._name_or_path = model.name_or_path = name_or_path
    elif (gguf := gguf_info(path)) is not None:  # the .gguf file, not the cache directory converted from it
        model.config._name_or_path = model.name_or_path = gguf["source"]
    return model, tokenizer


def _load_adapter(path: Path, name: str, *, dtype, device, adapter: AdapterLoad, base_revision: str | None):
    """A LoRA adapter directory onto its base model (a directory or Hub id); its tokenizer, or the base's."""
    PeftModel = _peft(f"model {name} (a LoRA adapter)").PeftModel

    recorded = json.loads((path / "adapter_config.json").read_text())
    base_name = adapter.base_model or recorded.get("base_model_name_or_path")
    if not base_name:
        raise ModelError(f"model {name}: LoRA adapter without a recorded base model; pass the base with --model")
    revision = base_revision or recorded.get("revision")
    base, _ = load_policy(base_name, dtype=dtype, device=device, revision=revision, with_tokenizer=False)
    own = any((path / f).exists() for f in TOKENIZER_FILES)
    tokenizer = load_tokenizer(path, name) if own else \
        load_tokenizer(resolve_model_path(base_name, revision=revision), base_name)
    with quiet_peft():
        model = PeftModel.from_pretrained(base, path, is_trainable=adapter.trainable).to(device)
    return model, tokenizer


def _peft(what: str):
    """The peft module, or a one-line error naming the install command."""
    try:
        import peft
    except ImportError:
        raise ModelError(f"{what} needs the peft package: pip install 'gspo[lora]'") from None
    return peft


def add_lora(model, *, r: int, alpha: float, dropout: float, target_modules: list[str], revision: str | None = None):
    """Wrap `model` with trainable LoRA adapters (PEFT); the base weights are frozen. `revision`:
    the Hub revision of the base, recorded in the adapter's config with its name."""
    peft = _peft("--lora-r")
    LoraConfig, get_peft_model = peft.LoraConfig, peft.get_peft_model

    targets = target_modules[0] if list(target_modules) == ["all-linear"] else list(target_modules)
    try:
        cfg = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type="CAUSAL_LM")
        with quiet_peft():
            return get_peft_model(model, cfg, revision=revision)
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

    return cast_parameters(copy.deepcopy(model), dtype)


def cast_parameters(model, dtype: torch.dtype):
    """`model` with its parameters cast to `dtype` in place, one at a time (buffers as they are:
    low_precision_copy); a rollout worker holds its policy this way."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype)
    return model


_DROPOUT_KEYS = ("attention_dropout", "hidden_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
                        "resid_pdrop", "embd_pdrop", "attn_pdrop", "dropout", "activation_dropout")


def enable_checkpointing(model) -> None:
    """Gradient (activation) checkpointing, non-reentrant: transformers 5 renamed the method
    (the old name warns), older releases have the old name only."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable({"use_reentrant": False})


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


@contextlib.contextmanager
def quiet_peft():
    """While peft (0.21) wraps a model or loads an adapter, two warnings neither the user's nor gspo's
    to fix: transformers' deprecated `is_gradient_checkpointing` (peft reads it), and "rank_pattern
    keys ... were ignored" for the one key peft writes itself for a fused expert parameter (tiny-moe's
    `gate_up_proj`: r and alpha x2), which it does apply: its check looks at module names only
    (tests/test_quiet.py checks the rank). Any other key still warns."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        warnings.filterwarnings("ignore", category=RuntimeWarning, message=r"The following (rank|alpha)_pattern keys "
                                r"did not match any targeted module and were ignored: \['\.\*\\\\\.gate_up_proj'\]\.$")
        yield
