"""Learned reward models: an AutoModelForSequenceClassification as a reward, the way TRL uses one.

    from gspo.rewards.model import RewardModel, reward_model_path
    rm = RewardModel.load(reward_model_path("Skywork/Skywork-Reward-V2-Qwen3-0.6B"), device="cuda")
    rm(completions=[" 4"], prompts=["2+2="])        # [score]: logits[:, 0] of "2+2= 4"

A `--reward` that is a local directory whose config.json architectures end in
`ForSequenceClassification`, or a Hugging Face Hub id (`org/name`, resolved by gspo.io.hub), is a
learned reward. It scores `prompt + completion` as TRL's GRPOTrainer does (`_calculate_rewards`):

- conversational rows (the prompt is chat messages, the completion
  `[{"role": "assistant", "content": ...}]`): the conversation prompt + completion rendered by the
  REWARD MODEL's own chat template (`apply_chat_template(..., tokenize=False)`), never the
  policy's; plain-text rows: the string `prompt + completion`;
- tokenized by its own tokenizer with right padding and `add_special_tokens=False`, in batches
  of `batch_size`, under `torch.inference_mode()`; the reward is `logits[:, 0]` (the model reads
  the last non-pad token, so the tokenizer's pad token, set from EOS when missing, is written
  into `model.config.pad_token_id`).

It is loaded once, in eval mode with no gradients, on the policy's device or
`--reward-model-device`, in its config's dtype on a GPU (a bfloat16 reward model stays
bfloat16) and float32 on the CPU. Only `num_labels == 1` models are rewards. Left out: reward
models that need `trust_remote_code`, truncation of texts longer than the model's positions.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from gspo.tasks.scoring import RewardError, completion_text

DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|mps|auto)$")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_device(device: str | None) -> None:
    """`--reward-model-device`: None (the policy's device), cpu, cuda, cuda:N, mps or auto."""
    from gspo.config import ConfigError

    if device is not None and not (isinstance(device, str) and DEVICE.match(device)):
        raise ConfigError(f"reward_model_device: must be cpu, cuda, cuda:N, mps or auto (got {device!r})")


def reward_model_path(spec: str) -> Path | None:
    """The local directory of a learned reward named by `spec` (a directory, or a hub id
    `org/name`); None when `spec` names neither. A directory that is not a
    sequence-classification model, or a hub id that cannot be resolved, is a one-line error."""
    from gspo.io import hub

    path = Path(spec).expanduser()
    if not path.is_dir():
        if "/" not in spec or not hub.looks_like_hub_id(spec):
            return None
        try:
            path = hub.model_dir(spec)
        except hub.HubError as e:
            raise RewardError(f"reward {spec!r}: no such directory, and as a Hugging Face Hub id: {e}") from None
    config = path / "config.json"
    if not config.is_file():
        raise RewardError(f"reward {spec!r}: {path} has no config.json, not a Hugging Face model directory")
    arch = json.loads(config.read_text()).get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in arch):
        raise RewardError(f"reward {spec!r}: {path} is not a reward model (config.json architectures "
                          f"{arch or 'missing'}; a learned reward is an AutoModelForSequenceClassification)")
    return path


def load_dtype(config, device: torch.device) -> torch.dtype:
    """The config's dtype on an accelerator (bfloat16 stays bfloat16); float32 on the CPU."""
    if device.type == "cpu":
        return torch.float32
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype if dtype in DTYPES.values() else torch.float32
    return DTYPES.get(str(dtype).removeprefix("torch."), torch.float32)


class RewardModel:
    """A sequence-classification model and its own tokenizer, called as a reward function."""

    def __init__(self, model, tokenizer, *, name: str, batch_size: int = 32):
        if tokenizer.pad_token_id is None:  # as TRL: pad with EOS, and tell the model which id pads
            if tokenizer.eos_token is None:
                raise RewardError(f"reward model {name}: its tokenizer has neither a pad nor an EOS token")
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.__name__ = name  # the metric name: reward/<name>/mean

    @classmethod
    def load(cls, path: Path, *, spec: str | None = None, device: str | torch.device = "cpu",
             batch_size: int = 32) -> RewardModel:
        """Load the model at `path` (from reward_model_path) with its own tokenizer."""
        import transformers
        from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

        from gspo.models.loading import resolve_device

        transformers.utils.logging.disable_progress_bar()
        spec = spec or str(path)
        device = resolve_device(device) if isinstance(device, str) else device
        try:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            if config.num_labels != 1:
                raise RewardError(f"reward {spec!r}: num_labels is {config.num_labels}; a reward model scores with "
                                  "one logit (num_labels=1)")
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            with torch.inference_mode():
                model = AutoModelForSequenceClassification.from_pretrained(
                    path, dtype=load_dtype(config, device), local_files_only=True).to(device)
        except RewardError:
            raise
        except Exception as e:  # an unknown model_type, a missing tokenizer or weights file, ...
            raise RewardError(f"reward {spec!r}: cannot load the reward model at {path}: {type(e).__name__}: "
                              f"{' '.join(str(e).split())[:200]}") from None
        model.eval().requires_grad_(False)
        return cls(model, tokenizer, name=spec.rstrip("/").split("/")[-1], batch_size=batch_size)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def texts(self, prompts: list, completions: list) -> list[str]:
        """What the model reads: the chat-rendered conversation, or prompt + completion."""
        out = []
        for p, c in zip(prompts, completions, strict=True):
            if isinstance(p, list):  # chat messages: the reward model's own template renders them
                if not self.tokenizer.chat_template:
                    raise RewardError(f"reward model {self.__name__}: prompts are chat messages but its "
                                      "tokenizer has no chat template")
                done = c if isinstance(c, list) else [{"role": "assistant", "content": completion_text(c)}]
                out.append(self.tokenizer.apply_chat_template(p + done, tokenize=False))
            else:
                out.append(p + completion_text(c))
        return out

    def __call__(self, completions: list, prompts: list, **_) -> list[float]:
        texts, scores = self.texts(prompts, completions), []
        with torch.inference_mode():
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(text=texts[i:i + self.batch_size], return_tensors="pt", padding=True,
                                     padding_side="right", add_special_tokens=False).to(self.device)
                scores += self.model(**enc).logits[:, 0].float().tolist()  # (b,)
        return scores
