"""PPO's critic as the trainer holds it: a plug-in with three shapes, one of them a null object.

    critic = make_critic(cfg, policy, resume_from, device, from_object=False)
    optimizer, scheduler = make_optimizers(cfg, policy, critic)   # + critic.param_groups
    run.trainables = [policy's, *critic.trainables(cfg, dist, mixed, scaler)]

- `NoCritic` (a run whose advantage estimator reads no values: every algorithm but PPO): no
  value term, nothing saved.
- `SharedCritic` (`--critic shared`): a value head on the policy's trunk, a second parameter
  group of the policy's optimizer, its loss added to the policy's (`vf_coef`), one backward.
- `SeparateCritic` (`--critic separate`): a second model with its own optimizer and schedule
  (a second `Trainable`), its loss backpropagated apart.

Each answers what the trainer asks, so the loop has no PPO branch: `param_groups` and
`trainables` (what it adds to the optimizers), `needs_hidden` and `forward` (its values in
an update's forward), `loss` (its loss term), `before_step` (gradients no wrapper reduces),
`old_values` (the values the step's advantage estimator reads, gspo.train.batch.advantages: none
without a critic), `saved` (what a checkpoint writes of it, under the keys and
directories gspo has always used) and `step_metrics` (its row of metrics.jsonl).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch

from gspo.algo.advantages import ESTIMATORS
from gspo.algo.losses import LOSSES
from gspo.config import TrainConfig
from gspo.models.loading import DTYPES, disable_dropout, unwrap
from gspo.models.logprobs import Split, forward_logprobs, passes
from gspo.models.value import Critic, ValueHead, explained_variance, value_loss
from gspo.processes import parallel
from gspo.train.optim import Trainable, adamw, schedule

Tensor = torch.Tensor

if TYPE_CHECKING:
    from gspo.processes.distributed import Dist


class Forwards(Protocol):
    """What a critic reads of its run (a gspo.train.run.Run is one): where its forwards run."""

    cfg: TrainConfig
    dist: Dist
    policy: torch.nn.Module
    train_model: torch.nn.Module | None  # the log-prob forward, DDP-wrapped or FSDP-sharded: a shared head's root

    def autocast(self): ...


class ValueRows(Protocol):
    """What the value loss reads of a micro-batch's rows (gspo.train.batch.Rows)."""

    old_values: Tensor | None
    returns: Tensor | None



def estimator_name(cfg: TrainConfig) -> str:
    """The run's advantage estimator (gspo.algo.advantages.ESTIMATORS): GAE for a loss whose
    advantages are not a group's (PPO's: LossInfo.group_advantages), else --adv-scale's."""
    return cfg.loss.adv_scale if LOSSES[cfg.loss.algorithm].group_advantages else "gae"


def make_critic(cfg: TrainConfig, policy, resume_from: Path | None, device: torch.device, from_object: bool = False):
    """The run's critic: none unless its estimator reads values (PPO's GAE); a separate one
    initialised from the policy's weights (or the API's model object's), or a shared head
    (zero-initialised); restored from the checkpoint."""
    if not ESTIMATORS[estimator_name(cfg)].needs_values:
        return NoCritic()
    if cfg.ppo.critic == "separate" and resume_from is None and from_object:  # the critic copies the object's trunk
        critic = Critic.from_model(unwrap(policy)).to(device)
        disable_dropout(critic)
        return SeparateCritic(critic, cfg)
    if cfg.ppo.critic == "separate":
        src = resume_from / "critic" if resume_from is not None else cfg.policy.model
        critic = Critic.from_pretrained(src, dtype=DTYPES[cfg.policy.param_dtype], device=device,
                                        revision=cfg.policy.revision,
                                        head_from=resume_from / "critic" if resume_from else None)
        disable_dropout(critic)
        return SeparateCritic(critic, cfg)
    head = ValueHead(unwrap(policy).config.hidden_size)
    if resume_from is not None:
        head.load(resume_from / "value_head")
    return SharedCritic(head.to(device), cfg)


class NoCritic:
    """No value model (GRPO, GSPO, ...: their estimators read no values); nothing to train, save or log."""

    needs_hidden = False  # the update's forward returns the policy's hidden states for it

    def param_groups(self, lr: float) -> list[dict]:
        return []

    def optimized(self, policy):
        """The modules whose parameters the policy optimizer holds (FSDP names its state by them)."""
        return policy

    def trainables(self, cfg: TrainConfig, dist, mixed, scaler) -> list[Trainable]:
        return []

    def before_step(self, dist) -> None:
        pass

    def forward(self, mb, hidden: Tensor | None, packed: bool = False) -> Tensor | None:
        return None

    def loss(self, loss: Tensor, values, rows: ValueRows, mask: Tensor, tok_scale: float) -> tuple[Tensor, None, dict]:
        return loss, None, {}

    def old_values(self, run: Forwards, ro, split: Split) -> None:
        """No value model: no values (the run's estimator needs none)."""
        return None

    def saved(self, dist) -> dict:
        return {}

    def step_metrics(self, batch, dist) -> dict:
        return {}


class _ValueCritic(NoCritic):
    """What both value models share: the values GAE reads (`old_values`), the clipped value loss."""

    def __init__(self, cfg: TrainConfig):
        self.clip_range, self.vf_coef = cfg.ppo.value_clip, cfg.ppo.vf_coef

    def _values(self, run: Forwards, mb, split: Split) -> Tensor:
        raise NotImplementedError

    def _root(self, run: Forwards):
        """What FSDP gathers for the no-grad value pass."""
        return run.train_model

    @torch.no_grad()
    def values(self, run: Forwards, ro, split: Split) -> Tensor:
        """V(s_t) of every completion token, without gradient, in the micro-batches of `split`. (B, T)"""
        B, T = ro.completion_mask.shape
        out = None
        for m in passes(ro, split.groups(ro, torch.arange(B)), split.budget):
            values = self._values(run, m.rollout, split)  # (b, t)
            out = values.new_zeros((B, T)) if out is None else out  # (B, T) in the head's dtype
            out[m.idx, m.ts] = values
        return out * ro.completion_mask

    def old_values(self, run: Forwards, ro, split: Split) -> Tensor:
        """V(s_t) (B, T) of the batch's tokens before the step's updates: the values its estimator
        reads (GAE) and the value loss's clipping anchor; FSDP's parameters gathered."""
        with run.autocast(), parallel.gathered(self._root(run), run.dist):
            return self.values(run, ro, split)  # (B, T)

    def _value_loss(self, values: Tensor, rows: ValueRows, mask: Tensor) -> tuple[Tensor, dict]:
        return value_loss(values, rows.old_values, rows.returns, mask, clip_range=self.clip_range)

    def step_metrics(self, batch, dist) -> dict:
        """The value model's mean and explained variance over the global batch's completion tokens."""
        on = batch.rollout.completion_mask > 0
        v, r = dist.gather(batch.old_values[on]), dist.gather(batch.returns[on])  # completion tokens of all processes
        return {"value/mean": float(v.mean()) if v.numel() else 0.0,
                "value/explained_variance": explained_variance(v, r, torch.ones_like(v))}


class SharedCritic(_ValueCritic):
    """A value head on the policy's trunk: its parameters a second group of the policy's optimizer."""

    needs_hidden = True

    def __init__(self, head: ValueHead, cfg: TrainConfig):
        super().__init__(cfg)
        self.head = head

    def param_groups(self, lr: float) -> list[dict]:
        return [{"params": list(self.head.parameters()), "lr": lr}]  # trains with the policy, at the critic's rate

    def optimized(self, policy):
        return torch.nn.ModuleDict({"policy": policy, "value_head": self.head})

    def before_step(self, dist) -> None:
        dist.average_grads(self.head.parameters())  # the replicated head no wrapper owns

    def forward(self, mb, hidden: Tensor | None, packed: bool = False) -> Tensor:
        return self.head(hidden)  # (b, T) from the policy's hidden states

    def loss(self, loss: Tensor, values: Tensor, rows: ValueRows, mask: Tensor, tok_scale: float):
        vloss, metrics = self._value_loss(values, rows, mask)
        return loss + self.vf_coef * (vloss * tok_scale), None, metrics  # one backward through the shared trunk

    def _values(self, run: Forwards, mb, split: Split) -> Tensor:
        hidden = forward_logprobs(run.policy, mb, temperature=run.cfg.sampling.temperature, packed=split.packed,
                                  hidden=True).hidden
        return self.head(hidden)  # (b, t)

    def saved(self, dist) -> dict:
        return {"value_head": (self.head, None)}


class SeparateCritic(_ValueCritic):
    """A second model (trunk + head) with its own optimizer and schedule: a second Trainable."""

    def __init__(self, critic: Critic, cfg: TrainConfig):
        super().__init__(cfg)
        self.critic = critic
        self.train = critic  # what training forwards call: the critic, or its DDP wrapper

    def trainables(self, cfg: TrainConfig, dist, mixed, scaler) -> list[Trainable]:
        self.train = parallel.wrap(self.critic, dist, mixed=mixed)
        optimizer = adamw(self.critic.parameters(), cfg.ppo.critic_lr, cfg)
        return [Trainable(self.critic, optimizer, schedule(optimizer, cfg), scaler, train=self.train,
                          metric="value/grad_norm", keys=("critic_optimizer", "critic_scheduler"))]

    def forward(self, mb, hidden: Tensor | None, packed: bool = False) -> Tensor:
        return self.train(mb, packed=packed)  # (b, T)

    def loss(self, loss: Tensor, values: Tensor, rows: ValueRows, mask: Tensor, tok_scale: float):
        vloss, metrics = self._value_loss(values, rows, mask)
        return loss, vloss * tok_scale, metrics

    def _root(self, run: Forwards):
        return self.train

    def _values(self, run: Forwards, mb, split: Split) -> Tensor:
        return self.critic(mb, packed=split.packed)  # (b, t)

    def saved(self, dist) -> dict:
        return {"critic": (self.critic, parallel.full_state_dict(self.critic, dist))}

