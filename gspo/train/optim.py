"""The optimizers of a run, their learning-rate schedule, and the trainables the loop steps.

    from gspo.train.optim import make_optimizers, lr_factor, Trainable
    optimizer, scheduler = make_optimizers(cfg, policy, critic)   # AdamW + LambdaLR
    lr_factor(cfg)(k - 1)                                         # the multiplier at step k
    metrics = {t.metric: t.step(max_norm) for t in run.trainables}

AdamW over the policy's trainable parameters (a shared value head as a second group at
--critic-lr: `critic.param_groups`); a separate critic gets its own AdamW and schedule
(gspo.train.critic). A `Trainable` is what the loop steps: a model, its optimizer, its schedule and
the loss scaler (the policy's; with a separate critic, the critic's too). The schedule is
linear warm-up, then constant, cosine or linear decay, advanced once per training step. Left
out: other optimizers (8-bit, Muon), per-layer learning rates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gspo.algo.metrics import Mean
from gspo.config import TrainConfig
from gspo.processes import parallel


@dataclass
class Trainable:
    """A model the loop trains, with its optimizer, LR schedule and loss scaler (float16; else None)."""

    model: torch.nn.Module  # the modules the optimizer holds (FSDP names its state by them)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None = None
    train: torch.nn.Module | None = None  # what training forwards call (its DDP wrapper): no_sync acts on it
    metric: str = "grad_norm"  # its gradient norm's metric
    keys: tuple[str, str] = ("optimizer", "scheduler")  # its states' keys in a checkpoint

    def step(self, max_norm: float) -> Mean:
        """After a minibatch's backward passes: gradient clipping by global norm and the AdamW
        step (float16: unscaled first, skipped on overflow); returns the gradient norm."""
        scaler, optimizer = self.scaler, self.optimizer
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = Mean(parallel.clip_grad_norm(params, max_norm))  # the same on every process
        (scaler.step(optimizer) if scaler is not None else optimizer.step())
        optimizer.zero_grad(set_to_none=True)
        return norm


def adamw(params, lr: float, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; fused (one kernel per parameter instead of ~10 passes over it) where `fusable` says so."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    return torch.optim.AdamW(groups, lr=lr, betas=cfg.optim.adam_betas, weight_decay=cfg.optim.weight_decay,
                             fused=fusable(tensors, cfg))


def fusable(params: list, cfg: TrainConfig) -> bool:
    """Whether torch's fused AdamW serves these parameters: plain tensors (not FSDP's DTensors) on
    the CPU or CUDA, in fp32 or bf16, and no fp16 loss scaler (it would unscale into the fused
    step). On 35M fp32 parameters on 2 CPU cores the fused step takes ~0.01 s, the default
    per-tensor one ~0.07 s; the two agree to float rounding (tests/test_optim.py)."""
    return (cfg.policy.dtype != "float16" and bool(params)
            and all(type(p.data) is torch.Tensor and p.device.type in ("cpu", "cuda")
                    and p.dtype in (torch.float32, torch.bfloat16) for p in params))


def schedule(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))


def make_optimizers(cfg: TrainConfig, policy, critic):
    """AdamW and its LR schedule for the policy, and the parameter groups the critic adds to it
    (a shared value head, at critic_lr; gspo.train.critic)."""
    groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": cfg.optim.lr},
              *critic.param_groups(cfg.ppo.critic_lr)]
    optimizer = adamw(groups, cfg.optim.lr, cfg)
    return optimizer, schedule(optimizer, cfg)


def lr_factor(cfg: TrainConfig):
    """LR multiplier for training step k (1-based; LambdaLR's counter is k - 1). After warm-up
    the decay starts at 1 on the first step and reaches 0 one step after the last, so the
    last step still learns (progress (k - warmup - 1) / (steps - warmup))."""

    def f(counter: int) -> float:
        k = counter + 1
        if cfg.optim.warmup_steps and k <= cfg.optim.warmup_steps:
            return k / cfg.optim.warmup_steps
        if cfg.optim.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (k - cfg.optim.warmup_steps - 1) / max(1, cfg.run.steps - cfg.optim.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.optim.lr_schedule == "cosine" else 1.0 - progress

    return f
