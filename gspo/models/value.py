"""The value model (critic) for PPO, and its clipped value loss.

    critic = Critic.from_pretrained("tiny")               # policy architecture + a scalar head
    values = critic(rollout)                              # (B, T) V(s_t) for each completion token
    loss, metrics = value_loss(values, old_values, returns, mask, clip_range=0.2)

Its GAE advantages are gspo.algo.advantages' (the estimator `gae`).

How the trainer holds it (no critic, a shared head, a separate critic) is gspo.train.critic's.

Two layouts (`--critic`):
- `separate` (default, the seeds' PPO): a second model with the policy's architecture,
  initialised from the policy's weights (its transformer trunk, without the LM head), plus a
  linear value head on the final hidden state of each position. Its own optimizer and
  learning rate; with LoRA (`--lora-r`) the critic is the base model's trunk, trained in
  full weights while the policy trains its adapters (as TRL's PPOTrainer with a PEFT policy).
  About twice the policy's memory for weights, gradients and Adam state:
  the cost GRPO and GSPO remove.
- `shared`: a value head on the policy's own trunk (`ValueHead`), trained through the same
  backward pass with `vf_coef` weighting; cheaper, but policy and value gradients interfere.

The value of completion token t is read at the position that predicts it (the state before
the token), the same positions `completion_logprobs` reads logits at.

Left out: a value model of a different size than the policy, and reward models (the
rewards here are verifiers).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from gspo.algo.metrics import Mean
from gspo.models.loading import resolve_model_path
from gspo.models.logprobs import completion_hidden
from gspo.models.sequences import Rollout

Tensor = torch.Tensor
HEAD_FILE = "value_head.pt"


class ValueHead(nn.Module):
    """hidden (…, H) -> value (…,), in the head's dtype (float32); starts at exactly 0 (zero-initialised)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)  # float32 (or the head's dtype)

    def save(self, directory: Path) -> None:
        torch.save(self.state_dict(), Path(directory) / HEAD_FILE)

    def save_pretrained(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.save(directory)

    def load(self, directory: Path) -> None:
        self.load_state_dict(torch.load(Path(directory) / HEAD_FILE, map_location="cpu", weights_only=True))


class Critic(nn.Module):
    """A separate value model: a transformer trunk (no LM head) and a ValueHead."""

    def __init__(self, trunk, head: ValueHead):
        super().__init__()
        self.trunk = trunk
        self.head = head

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype=torch.float32, device="cpu", head_from: Path | None = None,
                        revision: str | None = None):
        """The trunk of the causal LM at `path` (a directory, built-in name or Hub id at `revision`);
        the head zero-initialised, or loaded from `head_from`."""
        from transformers import AutoModel  # transformers loads on first use

        trunk = AutoModel.from_pretrained(resolve_model_path(str(path), revision=revision), dtype=dtype,
                                          local_files_only=True)
        head = ValueHead(trunk.config.hidden_size)
        if head_from is not None:
            head.load(head_from)
        return cls(trunk, head).to(device)

    @classmethod
    def from_model(cls, model):
        """A copy of a causal LM's trunk (its backbone, without the LM head) and a fresh head.
        The base model under a LoRA policy (gspo.models.loading.unwrap) holds PEFT's adapter layers in
        place of its linears: the copy takes the base layers back out (the adapters are the
        policy's, not the critic's) and trains every weight."""
        trunk = copy.deepcopy(getattr(model, model.base_model_prefix))
        for name, m in list(trunk.named_modules()):
            if name and hasattr(m, "get_base_layer") and hasattr(m, "base_layer"):  # a PEFT LoRA layer
                parent, _, child = name.rpartition(".")
                setattr(trunk.get_submodule(parent) if parent else trunk, child, m.get_base_layer())
        trunk.requires_grad_(True)  # PEFT froze the base
        head = ValueHead(trunk.config.hidden_size)
        return cls(trunk, head.to(next(trunk.parameters()).device))

    def forward(self, mb: Rollout, packed: bool = False) -> Tensor:
        """V(s_t) of each completion token of a (micro-)batch, read at the state before it: (b, T)."""
        # a copy, not a view (FSDP hooks the output)
        return self.head(completion_hidden(self.trunk, mb, packed)).clone()

    def save_pretrained(self, directory: Path, state_dict: dict | None = None) -> None:
        """The trunk in Hugging Face format and the head; state_dict: a full state dict of this
        Critic to write instead of the module's own (FSDP gathers one)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        if state_dict is None:
            self.trunk.save_pretrained(directory)
            self.head.save(directory)
            return
        self.trunk.save_pretrained(directory, state_dict={k[len("trunk."):]: v for k, v in state_dict.items()
                                                          if k.startswith("trunk.")})
        torch.save({k[len("head."):]: v for k, v in state_dict.items() if k.startswith("head.")},
                   directory / HEAD_FILE)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip_range: float) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss, averaged over completion tokens.

    V_clip = V_old + clip(V - V_old, -ε_v, ε_v)
    loss_t = ½ · max((V - R)², (V_clip - R)²)     (the pessimistic one; ε_v = 0 disables clipping)

    Returns the loss and `value/loss`, `value/clip_frac` (fraction of tokens where the clipped
    term is the larger and V is outside the clip range, i.e. the gradient is cut).
    """
    # at least float32 whatever the head's dtype: in bf16 (autocast) 1001 tokens sum to 1000
    dt = torch.promote_types(values.dtype, torch.float32)
    values, old_values, returns, mask = (x.to(dt) for x in (values, old_values, returns, mask))  # (B, T)
    n = mask.sum().clamp(min=1.0)
    err = (values - returns).square()  # (B, T)
    if clip_range > 0:
        clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)  # (B, T)
        err_clipped = (clipped - returns).square()  # (B, T)
        per_token = 0.5 * torch.maximum(err, err_clipped)  # (B, T)
        with torch.no_grad():  # the clamp is active and the clipped error is the larger one
            cut = ((values - old_values).abs() > clip_range) & (err_clipped > err)  # (B, T)
            clip_frac = float((cut.to(values.dtype) * mask).sum() / n)
    else:
        per_token = 0.5 * err
        clip_frac = 0.0
    loss = (per_token * mask).sum() / n
    tokens = float(mask.sum())
    return loss, {"value/loss": Mean(loss.detach(), tokens), "value/clip_frac": Mean(clip_frac, tokens)}


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over completion tokens: 1 is perfect, 0 no better than a constant.

    NaN when the returns have no variance (nothing to explain).
    """
    m = mask > 0
    v, r = values[m].double(), returns[m].double()
    var_r = r.var(unbiased=False) if r.numel() else r.new_zeros(())
    if r.numel() == 0 or var_r == 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var_r)
