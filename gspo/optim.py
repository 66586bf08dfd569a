"""The optimizers of a run and their learning-rate schedule.

    from gspo.optim import make_optimizers, lr_factor
    optimizer, scheduler = make_optimizers(cfg, policy, value_model)   # AdamW + LambdaLR
    lr_factor(cfg)(k - 1)                                              # the multiplier at step k

AdamW over the policy's trainable parameters (a shared value head as a second group at
--critic-lr); a separate critic gets its own AdamW and schedule. The schedule is linear
warm-up, then constant, cosine or linear decay, advanced once per training step. Left out:
other optimizers (8-bit, Muon), per-layer learning rates.
"""

from __future__ import annotations

import math

import torch

from gspo.config import TrainConfig
from gspo.value import ValueModel


def make_optimizers(cfg: TrainConfig, policy, vm: ValueModel | None):
    """AdamW and its LR schedule for the policy (and a shared value head, at critic_lr); a
    separate critic gets its own AdamW and schedule on `vm`."""
    groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": cfg.lr}]
    if vm is not None and vm.shared:  # the shared value head trains with the policy, at the critic's rate
        groups.append({"params": list(vm.head.parameters()), "lr": cfg.critic_lr})
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    if vm is not None and not vm.shared:
        vm.optimizer = torch.optim.AdamW(vm.critic.parameters(), lr=cfg.critic_lr, betas=cfg.adam_betas,
                                         weight_decay=cfg.weight_decay)
        vm.scheduler = torch.optim.lr_scheduler.LambdaLR(vm.optimizer, lr_factor(cfg))
    return optimizer, scheduler


def lr_factor(cfg: TrainConfig):
    """LR multiplier for training step k (1-based; LambdaLR's counter is k - 1). After warm-up
    the decay starts at 1 on the first step and reaches 0 one step after the last, so the
    last step still learns (progress (k - warmup - 1) / (steps - warmup))."""

    def f(counter: int) -> float:
        k = counter + 1
        if cfg.warmup_steps and k <= cfg.warmup_steps:
            return k / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (k - cfg.warmup_steps - 1) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress

    return f
