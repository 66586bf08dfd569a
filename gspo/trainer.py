"""The training loop: rollout → score → advantages → minibatch updates, one step at a time.

    from gspo.config import TrainConfig
    from gspo.trainer import train
    summary = train(TrainConfig(algorithm="gspo", steps=60))
    summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]

`train` reads top to bottom: set up (or resume) → evaluate the starting policy → for each step
`train_step` → evaluate again → summary. `train_step` is one GSPO/GRPO step and can be called
alone: sample a group per prompt (`rollout`), score it (`score`), turn rewards into
group-relative advantages, get the old policy's log-probs, then `update` the policy over
`num_minibatches` minibatches for `epochs` passes. All but the first minibatch of the first
epoch are off-policy: that is where the ratios move and clipping acts.

Set-up validates everything a user gave (config, dataset rows, rewards, model) before the
run directory is created, so bad input never leaves a half-made run behind.

PPO (`--algorithm ppo`) differs in two places only: advantages come from GAE over a learned
value model's estimates instead of group statistics (`ppo_advantages`), and each update also
trains the value model (`update`). See gspo.value for the critic.

Under torchrun every process runs this same loop on its share of each step's prompts; the
global-batch bookkeeping (which rows are whose, loss scales, metric reduction) is in
gspo.distributed and shows up here only as `dist` calls, the identity in one process.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from gspo import checkpoint as ckpt
from gspo import distributed
from gspo.advantages import gae, group_advantages, masked_whiten
from gspo.config import ConfigError, TrainConfig, load_yaml, resolve, to_dict
from gspo.data import DataError
from gspo.distributed import Dist
from gspo.evaluation import decode_completions, encode_prompts, evaluate
from gspo.losses import agg_count, policy_loss
from gspo.models import DTYPES, add_lora, load_policy, unwrap
from gspo.moe import MoEError, Routing, drift, is_moe, load_balancing_loss
from gspo.reporting import Reporter
from gspo.rewards import Reward, load_rewards, score_completions
from gspo.rollout import Rollout, completion_logprobs, generate
from gspo.tasks import build_task
from gspo.value import Critic, ValueHead, explained_variance, value_loss

Tensor = torch.Tensor


@dataclass
class Batch:
    """A scored rollout batch, ready for updates. B = prompts_per_step · group_size."""

    rollout: Rollout
    rewards: Tensor  # (B,) weighted sum of all rewards
    reward_parts: dict[str, list[float]]  # name -> (B,) each reward's values
    advantages: Tensor  # (B,) group-relative, or (B, T) from GAE (PPO)
    old_logp: Tensor  # (B, T) log π_θold of the sampled tokens
    ref_logp: Tensor | None  # (B, T) log π_ref, when beta > 0 or reward_kl_coef > 0
    examples: list  # (B / G,) the prompts' Examples
    completions: list[str]  # (B,) decoded completions
    old_values: Tensor | None = None  # (B, T) PPO: V_old(s_t) before the updates
    returns: Tensor | None = None  # (B, T) PPO: GAE returns, the value targets
    routing: Tensor | None = None  # (B, P+T, L, k) MoE: experts used under the old policy


@dataclass
class ValueModel:
    """PPO's critic: a separate model with its own optimizer, or a head on the policy's trunk."""

    critic: Critic | None = None  # --critic separate
    head: ValueHead | None = None  # --critic shared (its parameters live in the policy's optimizer)
    optimizer: torch.optim.Optimizer | None = None  # the separate critic's
    scheduler: object | None = None
    critic_train: object | None = None  # what training forwards call: the critic, or its DDP wrapper

    def critic_forward(self, input_ids: Tensor, attention_mask: Tensor, T: int) -> Tensor:
        return (self.critic_train or self.critic)(input_ids, attention_mask, T)

    @property
    def shared(self) -> bool:
        return self.head is not None

    def module(self):
        return self.head if self.shared else self.critic

    @torch.no_grad()
    def values(self, policy, ro: Rollout, temperature: float, batch_size: int) -> Tensor:
        """V(s_t) of every completion token, without gradient. (B, T)"""
        out = []
        for idx in torch.arange(ro.prompt_ids.shape[0]).split(batch_size):
            sub = ro.select(idx)
            if self.shared:
                _, hidden = completion_logprobs(policy, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                                temperature=temperature, return_hidden=True)
                out.append(self.head(hidden))
            else:
                out.append(self.critic(sub.input_ids, sub.attention_mask, sub.completion_mask.shape[1]))
        return torch.cat(out) * ro.completion_mask


# ----------------------------------------------------------------------------------------------
# The pieces of a step
# ----------------------------------------------------------------------------------------------


def step_generator(seed: int, step: int, purpose: str) -> torch.Generator:
    """A CPU generator that is a function of (seed, step, purpose) alone: a resumed run, or a
    run split across processes, draws the same numbers for the same step."""
    digest = hashlib.sha256(f"gspo-{seed}-{step}-{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def rollout(sampler, tokenizer, examples, cfg: TrainConfig, generator: torch.Generator,
            routing: Routing | None = None, rows: tuple[int, int] | None = None
            ) -> tuple[Rollout, list[str], list[list[int]]]:
    """Sample cfg.group_size completions per example with `sampler` (the policy, or its copy in
    --rollout-dtype); returns the rollout, texts and token ids. With `routing`, the experts used
    while sampling are recorded in the rollout. rows: (offset, total) of these rows in the
    global batch when several processes share it (see gspo.rollout.generate)."""
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in examples])
    ro = generate(sampler, prompts, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                  temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, generator=generator, min_new_tokens=cfg.min_new_tokens,
                  routing=routing, rows=rows)
    texts, ids = decode_completions(tokenizer, ro)
    return ro, texts, ids


def score(rewards: list[Reward], examples, completions: list[str], completion_ids, group_size: int):
    """Weighted reward of each completion (B,) and each reward's values; row b is example b // G."""
    total, parts = score_completions(rewards, examples, completions, completion_ids, group_size)
    return torch.tensor(total, dtype=torch.float32), parts


@torch.no_grad()
def sequence_logprobs(model, ro: Rollout, temperature: float, batch_size: int, routing: Routing | None = None):
    """log π of every sampled token under `model`, in chunks of rows, without gradient. (B, T)

    With `routing` (MoE), also returns the experts every token used, (B, P+T, L, k).
    """
    was_training = model.training
    model.eval()
    out, experts = [], []
    for idx in torch.arange(ro.prompt_ids.shape[0]).split(batch_size):
        sub = ro.select(idx)
        with routing.capture() if routing is not None else contextlib.nullcontext() as cap:
            out.append(completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                           temperature=temperature))
        if routing is not None:
            experts.append(cap.indices(*sub.input_ids.shape))
    model.train(was_training)
    if routing is not None:
        return torch.cat(out), torch.cat(experts)
    return torch.cat(out)


def update(policy, optimizer, batch: Batch, cfg: TrainConfig, generator: torch.Generator,
           vm: ValueModel | None = None, routing: Routing | None = None, dist: Dist | None = None) -> list[dict]:
    """`epochs` passes of clipped policy-gradient updates over `num_minibatches` minibatches
    (PPO: and clipped value-loss updates of the critic on the same minibatches).

    MoE (`routing`): every forward records the experts the current router picks; `moe/drift`
    compares them with the old policy's, and with --routing-replay the old experts are forced
    for the ratio's log-probs (`moe/drift_in_ratio` is then 0).

    Several processes (`dist`): `policy` is what training forwards call (the DDP wrapper, or
    the FSDP-sharded module). The minibatches are those of the global batch (one permutation
    of all processes' rows); each process takes its rows of each (possibly none: it then runs
    one row with zero weight, since every process must join every gradient reduction) and
    scales its loss so that the averaged gradient is that of the global minibatch's loss.
    """
    dist = dist or Dist()
    ro = batch.rollout
    B, T = ro.completion_mask.shape
    B_all, lo = B * dist.world, B * dist.rank  # this process holds global rows lo .. lo+B-1
    mb_size = B_all // cfg.num_minibatches
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    shared = vm is not None and vm.shared
    policy.train()
    history, weights = [], []
    for _ in range(cfg.epochs):
        order = torch.randperm(B_all, generator=generator)  # (B_all,) the same on every process
        minibatches = [g[(g >= lo) & (g < lo + B)] - lo for g in order.split(mb_size)]  # local row indices
        counts = torch.tensor([[float(agg_count(ro.completion_mask[idx], cfg.loss_agg)), float(ro.completion_mask[idx].sum())]
                               for idx in minibatches], dtype=torch.float64)  # (M, 2) responses/tokens, tokens
        scales = dist.loss_scales(counts).tolist()  # (M, 2): 1.0 on one process
        for idx, (n_agg, n_tok), (agg_scale, tok_scale) in zip(minibatches, counts.tolist(), scales):
            live = 1.0 if len(idx) else 0.0
            idx = idx if len(idx) else torch.zeros(1, dtype=torch.long)  # a zero-weight stand-in row
            mb = ro.select(idx)
            mask = mb.completion_mask * live  # (b, T)
            forced = batch.routing[idx] if (routing is not None and cfg.routing_replay) else None
            with routing.capture(forced, keep_logits=cfg.router_aux_loss_coef > 0) if routing is not None \
                    else contextlib.nullcontext() as cap:
                out = completion_logprobs(policy, mb.input_ids, mb.attention_mask, mask,
                                          temperature=cfg.temperature, return_hidden=shared)
            logp, hidden = out if shared else (out, None)  # (b, T), (b, T, H)
            loss, metrics = policy_loss(
                cfg.algorithm, logp, batch.old_logp[idx], batch.advantages[idx], mask,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.loss_agg, max_len=cfg.max_new_tokens,
                ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx], beta=cfg.beta,
                kl_estimator=cfg.kl_estimator,
            )
            loss = loss * agg_scale
            if routing is not None:
                aux, moe_metrics = moe_terms(cap, batch.routing[idx], mb.attention_mask * live, routing, cfg)
                loss = loss + aux * live
                metrics.update(moe_metrics)
            if vm is not None:
                values = vm.head(hidden) if shared else vm.critic_forward(mb.input_ids, mb.attention_mask, T)  # (b, T)
                vloss, vmetrics = value_loss(values, batch.old_values[idx], batch.returns[idx], mask,
                                             clip_range=cfg.value_clip)
                vloss = vloss * tok_scale
                metrics.update(vmetrics)
                if shared:
                    loss = loss + cfg.vf_coef * vloss  # one backward through the shared trunk
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if shared:
                dist.average_grads(vm.head.parameters())  # the replicated head no wrapper owns
            metrics["grad_norm"] = distributed.clip_grad_norm(params, max_norm)
            optimizer.step()
            if vm is not None and not shared:
                vm.optimizer.zero_grad(set_to_none=True)
                vloss.backward()
                metrics["value/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(vm.critic.parameters(), max_norm))
                vm.optimizer.step()
            history.append(metrics)
            weights.append({"tokens": n_tok, "agg": n_agg, "attention": float(mb.attention_mask.sum()) * live})
    return dist.reduce_metrics(history, weights)


def moe_terms(cap, old_routing: Tensor, tokens: Tensor, routing: Routing, cfg: TrainConfig) -> tuple[Tensor | float, dict]:
    """Expert drift of this forward against the old policy's routing, and the optional
    load-balancing loss. tokens: (b, P+T) attention mask: every real token counts."""
    b, S = tokens.shape
    metrics = {"moe/drift": drift(cap.natural_indices(b, S), old_routing, tokens),  # what the router picks
               "moe/drift_in_ratio": drift(cap.indices(b, S), old_routing, tokens)}  # what the experts got
    if cfg.router_aux_loss_coef == 0:
        return 0.0, metrics
    aux = load_balancing_loss([torch.cat(x) for x in cap.logits], tokens, routing.top_k)
    metrics["moe/aux_loss"] = float(aux.detach())
    return cfg.router_aux_loss_coef * aux, metrics


def mean_metrics(history: list[dict]) -> dict:
    """Average per-update metrics; min/max statistics take the min/max over updates."""
    out = {}
    for key in history[0]:
        vals = [h[key] for h in history if h[key] == h[key]]  # skip NaN
        if not vals:
            out[key] = float("nan")
        elif key.endswith("/min"):
            out[key] = min(vals)
        elif key.endswith("/max"):
            out[key] = max(vals)
        else:
            out[key] = sum(vals) / len(vals)
    return out


def reference_context(policy, reference):
    """Where the reference policy's log-probs come from: a frozen copy, or (LoRA) the base
    model with the adapters switched off, so no second copy of the weights is held."""
    if reference is not None:
        return reference, contextlib.nullcontext()
    return policy, policy.disable_adapter()


def mismatch_metrics(sampled: Tensor, recomputed: Tensor, mask: Tensor, gather=None) -> dict[str, float]:
    """How far the sampling pass's log-probs are from the training forward's (precision gap):
    per token, and per response as the length-normalised log-ratio GSPO's s_i would see.
    gather: concatenates per-row statistics over processes (Dist.gather)."""
    diff = (recomputed - sampled) * mask  # (B, T)
    rows = torch.stack([diff.abs().sum(-1), diff.sum(-1), mask.sum(-1)], -1)  # (B, 3)
    abs_sum, diff_sum, n_tok = (gather or (lambda t: t))(rows).unbind(-1)  # (B_all,) each
    seq = diff_sum / n_tok.clamp(min=1)  # (B_all,) (1/|y|) Σ_t (log π_train - log π_sample)
    has = n_tok > 0
    return {"mismatch/token_abs": float(abs_sum.sum() / n_tok.sum().clamp(min=1)),
            "mismatch/seq_log_ratio": float(seq[has].abs().mean()) if has.any() else 0.0}


def ppo_advantages(rewards: Tensor, old_values: Tensor, mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None,
                   cfg: TrainConfig, dist: Dist | None = None) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns (B, T) from the sequence reward at the last completion token,
    minus reward_kl_coef · (log π_old - log π_ref) on every token when that is on. Whitening
    uses the statistics of the global batch (all processes)."""
    token_rewards = rewards.to(old_values.device)  # (B,) placed at the last token by gae()
    if cfg.reward_kl_coef > 0:
        last = (mask.sum(-1).long() - 1).clamp(min=0)  # (B,)
        token_rewards = -cfg.reward_kl_coef * (old_logp - ref_logp) * mask  # (B, T)
        token_rewards[torch.arange(mask.shape[0]), last] += rewards.to(old_values.device)
    adv, returns = gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.gae_lambda)  # (B, T)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, mask, all_sum=dist.all_sum if dist is not None else None)
    return adv, returns


@dataclass
class Sampler:
    """Who samples: the policy itself, or a copy in --rollout-dtype synced before every rollout
    (an inference engine's precision); `routing` records MoE experts when the old log-probs
    are the sampling pass's."""

    model: object
    routing: Routing | None = None

    def sync(self, policy) -> None:
        if self.model is not policy:
            with torch.no_grad():
                for dst, src in zip(self.model.parameters(), policy.parameters()):
                    dst.copy_(src)


def train_step(step: int, policy, reference, tokenizer, task, rewards: list[Reward], optimizer, cfg: TrainConfig,
               vm: ValueModel | None = None, routing: Routing | None = None,
               sampler: Sampler | None = None, dist: Dist | None = None, train_model=None) -> tuple[dict, Batch]:
    """One step: rollout → score → old log-probs → advantages → updates. Returns (metrics, batch).

    Randomness is a function of (seed, step): the sampling uniforms and the minibatch order
    come from generators made for this step (`step_generator`).

    Several processes (`dist`): this process samples and scores its contiguous share of the
    step's prompts; `batch` holds its rows; advantages and metrics are those of the global
    batch. train_model: what training forwards call (the DDP wrapper; default `policy`).
    """
    dist = dist or Dist()
    t0 = time.perf_counter()
    sampler = sampler or Sampler(policy)
    sampler.sync(policy)
    all_examples = task.train_batch(step, cfg.prompts_per_step, cfg.seed)
    n = cfg.prompts_per_step // dist.world
    examples = all_examples[dist.rank * n:(dist.rank + 1) * n]  # whole groups per process
    G = cfg.group_size
    with dist.gathered(sampler.model):
        ro, completions, completion_ids = rollout(sampler.model, tokenizer, examples, cfg,
                                                  step_generator(cfg.seed, step, "sample"), sampler.routing,
                                                  rows=(dist.rank * n * G, cfg.prompts_per_step * G))
    t_rollout = time.perf_counter() - t0

    rewards_t, parts = score(rewards, examples, completions, completion_ids, G)  # (B,)
    all_rewards = dist.gather(rewards_t)  # (B_all,)
    mb_size = ro.prompt_ids.shape[0] // cfg.num_minibatches
    old_routing = None
    if cfg.old_logp == "sampling":
        old_logp, old_routing = ro.logp, ro.routing  # (B, T) recorded while sampling (paper §5.4)
    elif routing is not None:
        old_logp, old_routing = sequence_logprobs(policy, ro, cfg.temperature, mb_size, routing)  # (B, T)
    else:
        old_logp = sequence_logprobs(policy, ro, cfg.temperature, mb_size)  # (B, T)
    ref_logp = None
    if cfg.beta > 0 or cfg.reward_kl_coef > 0:
        model, ctx = reference_context(policy, reference)
        with ctx:
            ref_logp = sequence_logprobs(model, ro, cfg.temperature, mb_size)  # (B, T)
    old_values = returns = None
    if vm is not None:  # PPO: GAE over the critic's values
        old_values = vm.values(policy, ro, cfg.temperature, mb_size)  # (B, T)
        advantages, returns = ppo_advantages(rewards_t, old_values, ro.completion_mask, old_logp, ref_logp, cfg,
                                             dist)
    else:
        B = rewards_t.shape[0]
        advantages = group_advantages(all_rewards, G, scale=cfg.adv_scale)  # (B_all,)
        advantages = advantages[dist.rank * B:(dist.rank + 1) * B].to(ro.logp.device)  # (B,) this process's rows
    batch = Batch(ro, rewards_t, parts, advantages, old_logp, ref_logp, examples, completions, old_values, returns,
                  old_routing)

    t1 = time.perf_counter()
    history = update(train_model or policy, optimizer, batch, cfg, step_generator(cfg.seed, step, "minibatches"),
                     vm, routing, dist)
    t_update = time.perf_counter() - t1

    # metrics of the global batch: per-row values gathered from every process
    groups = all_rewards.view(-1, G)
    lengths = dist.gather(ro.lengths.float())  # (B_all,)
    mask = ro.completion_mask
    all_parts = {name: dist.gather(torch.tensor(v, dtype=torch.float64)) for name, v in parts.items()}
    metrics = {
        "step": step,
        "reward/mean": float(all_rewards.mean()),
        "reward/std": float(all_rewards.std()) if all_rewards.numel() > 1 else 0.0,
        "reward/flat_group_frac": float((groups.amax(1) == groups.amin(1)).float().mean()),
        **{f"reward/{name}/mean": float(v.mean()) for name, v in all_parts.items()},
        **mean_metrics(history),
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": float(lengths.max()),
        "completion/truncated_frac": float(dist.gather(ro.truncated.float()).mean()),
        **(mismatch_metrics(ro.logp, old_logp, mask, dist.gather) if cfg.old_logp == "recompute" else {}),
        "lr": optimizer.param_groups[0]["lr"],
    }
    if vm is not None:
        on = mask > 0
        v, r = dist.gather(old_values[on]), dist.gather(returns[on])  # completion tokens of all processes
        ones = torch.ones_like(v)
        metrics["value/mean"] = float(v.mean()) if v.numel() else 0.0
        metrics["value/explained_variance"] = explained_variance(v, r, ones)
    metrics.update({
        "time/rollout_seconds": t_rollout,
        "time/update_seconds": t_update,
        "time/step_seconds": time.perf_counter() - t0,
    })
    return metrics, batch


# ----------------------------------------------------------------------------------------------
# Set-up helpers
# ----------------------------------------------------------------------------------------------


def lr_factor(cfg: TrainConfig):
    """LR multiplier for training step k (1-based; LambdaLR's counter is k - 1)."""

    def f(counter: int) -> float:
        k = counter + 1
        if cfg.warmup_steps and k <= cfg.warmup_steps:
            return k / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (k - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress

    return f


def rng_state() -> dict:
    """Global RNG states (dropout in LoRA, user code); gspo's own draws use step_generator."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def samples_rows(step: int, batch: Batch, group_size: int, n: int) -> list[dict]:
    rows = []
    for i in range(min(n, len(batch.completions))):
        ex = batch.examples[i // group_size]
        rows.append({"step": step, "prompt": ex.prompt, "completion": batch.completions[i], "answer": ex.answer,
                     "reward": float(batch.rewards[i]), "advantage": float(batch.advantages[i].flatten()[0])})
    return rows


class Progress:
    """A tqdm bar on a terminal; otherwise a plain log line every ~10% of the run."""

    def __init__(self, cfg: TrainConfig, start: int, log):
        self.enabled, self.total, self.log = cfg.progress, cfg.steps, log
        self.bar = None
        self.every = max(1, cfg.steps // 10)
        if self.enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.steps, initial=start, desc=f"gspo train ({cfg.algorithm})", unit="step",
                            dynamic_ncols=True)

    def update(self, m: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{m['reward/mean']:.3f}", clip=f"{m['clip/frac']:.2g}")
            self.bar.update(1)
        elif m["step"] % self.every == 0 or m["step"] == self.total:
            self.log(f"step {m['step']}/{self.total}  reward {m['reward/mean']:.3f}  clip/frac {m['clip/frac']:.3g}"
                     f"  {m['time/step_seconds']:.2f}s/step")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def task_and_rewards(cfg: TrainConfig) -> tuple[object, list[Reward]]:
    """The task (built-in or the user's dataset, validated) and its reward functions."""
    task = build_task(task=cfg.task, dataset=cfg.dataset, dataset_split=cfg.dataset_split,
                      eval_dataset=cfg.eval_dataset, eval_split=cfg.eval_split, prompt_column=cfg.prompt_column,
                      answer_column=cfg.answer_column, eval_size=cfg.eval_size, rewards=cfg.reward)
    rewards = load_rewards(list(cfg.reward or task.default_rewards), list(cfg.reward_weights) or None,
                           format_pattern=cfg.format_pattern, max_new_tokens=cfg.max_new_tokens)
    return task, rewards


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


@dataclass
class Setup:
    """Everything a run needs, built and checked before the run directory is touched."""

    cfg: TrainConfig
    run_dir: Path
    task: object
    rewards: list[Reward]
    policy: object
    reference: object | None
    tokenizer: object
    device: torch.device
    resume_from: Path | None
    value_model: ValueModel | None = None
    routing: Routing | None = None
    sampler: Sampler | None = None
    dist: Dist = dataclasses.field(default_factory=Dist)
    train_model: object | None = None  # what training forwards call: the policy, or its DDP wrapper


def setup(cfg: TrainConfig, resume: str | Path | None) -> Setup:
    resume_from = None
    if resume is not None:
        run_dir = Path(resume)
        resume_from = ckpt.latest_checkpoint(run_dir)
        if resume_from is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoint to resume from")
        cfg = dataclasses.replace(load_yaml(run_dir / "config.yaml"), output_dir=str(run_dir))
    cfg = resolve(cfg)
    world = distributed.world_size_from_env()
    if cfg.prompts_per_step % world:
        raise ConfigError(f"prompts_per_step: must be divisible by the number of processes, {world}, so that "
                          f"each process samples whole groups (got {cfg.prompts_per_step})")
    dist = distributed.init(cfg.parallel, cfg.device)  # a single process without torchrun
    cfg = dataclasses.replace(cfg, output_dir=dist.broadcast_object(cfg.output_dir))  # rank 0's timestamp
    run_dir = Path(cfg.output_dir)
    if resume is None and run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"{run_dir}: output directory exists and is not empty (use --resume {run_dir} to continue it)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = dist.device
    dtype = DTYPES[cfg.dtype]

    task, rewards = task_and_rewards(cfg)
    if resume_from is not None and cfg.lora_r > 0:  # base model + the saved adapter, trainable
        policy, tokenizer = load_policy(str(resume_from), dtype=dtype, device=device, base_model=cfg.model,
                                        trainable_adapter=True)
    elif resume_from is not None:
        policy, tokenizer = load_policy(str(resume_from), dtype=dtype, device=device)
    else:
        policy, tokenizer = load_policy(cfg.model, dtype=dtype, device=device)
        if cfg.lora_r > 0:
            policy = add_lora(policy, r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                              target_modules=list(cfg.lora_target_modules))
    if any(ex.is_chat for ex in task.test_set()[:1] + task.train_batch(1, 1, cfg.seed)) and not tokenizer.chat_template:
        raise DataError(f"{cfg.dataset}: prompts are chat messages but the tokenizer of {cfg.model} has no chat template")
    if cfg.gradient_checkpointing:
        unwrap(policy).gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # the sampler: the policy, or a copy in another precision (made before any hook is installed)
    rollout_dtype = dtype if cfg.rollout_dtype == "same" else DTYPES[cfg.rollout_dtype]
    sampler = Sampler(policy if rollout_dtype == dtype else copy.deepcopy(policy).to(rollout_dtype))
    routing = None
    if is_moe(policy):  # drift is always measured on MoE models
        routing = Routing(policy, cfg.model)
        if cfg.old_logp == "sampling":
            sampler.routing = routing if sampler.model is policy else Routing(sampler.model, cfg.model)
    elif cfg.routing_replay or cfg.router_aux_loss_coef > 0:
        option = "--routing-replay" if cfg.routing_replay else "--router-aux-loss-coef"
        raise MoEError(f"{option}: {cfg.model} is not a Mixture-of-Experts model with router modules "
                       "(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE style)")
    reference = None
    if (cfg.beta > 0 or cfg.reward_kl_coef > 0) and cfg.lora_r == 0:
        reference, _ = load_policy(cfg.model, dtype=dtype, device=device)  # the initial policy, frozen
        reference.eval().requires_grad_(False)
    vm = None
    if cfg.algorithm == "ppo" and cfg.critic == "separate":  # initialised from the policy's weights
        src = resume_from / "critic" if resume_from is not None else cfg.model
        vm = ValueModel(critic=Critic.from_pretrained(src, dtype=dtype, device=device,
                                                      head_from=resume_from / "critic" if resume_from else None))
    elif cfg.algorithm == "ppo":
        head = ValueHead(unwrap(policy).config.hidden_size)
        if resume_from is not None:
            head.load(resume_from / "value_head")
        vm = ValueModel(head=head.to(device))
    train_model = policy
    if dist.enabled:  # DDP wrappers, or FSDP shards in place
        train_model = dist.wrap(policy, find_unused=routing is not None)  # MoE: unused experts get no grad
        if vm is not None and not vm.shared:
            vm.critic_train = dist.wrap(vm.critic)
        if reference is not None and dist.parallel == "fsdp":
            dist.shard(reference)
    return Setup(cfg, run_dir, task, rewards, policy, reference, tokenizer, device, resume_from, vm, routing, sampler,
                 dist, train_model)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, resume: str | Path | None = None, log=print) -> dict:
    """Train a policy; returns the summary (also written to summary.json in the run directory).

    resume: a run directory; training continues from its newest checkpoint with its saved
    configuration (`cfg` is then ignored).

    Under torchrun every process calls this; rank 0 alone writes the run directory and logs.
    """
    t_start = time.time()
    s = setup(cfg, resume)  # raises on any bad input; nothing written yet
    try:
        summary = _train(s, t_start, log if s.dist.is_main else (lambda *a, **k: None))
    except BaseException:
        s.dist.close(clean=False)
        raise
    s.dist.close()
    return summary


def _train(s: Setup, t_start: float, log) -> dict:
    cfg, run_dir, policy, tokenizer, task, rewards, dist = s.cfg, s.run_dir, s.policy, s.tokenizer, s.task, s.rewards, s.dist
    main = dist.is_main
    config_yaml = yaml.safe_dump(to_dict(cfg), sort_keys=False)

    vm = s.value_model
    optimizer, scheduler = make_optimizers(cfg, policy, vm)
    # the modules whose parameters the policy optimizer holds (FSDP names its state by them)
    optimized = torch.nn.ModuleDict({"policy": policy, "value_head": vm.head}) if vm is not None and vm.shared \
        else policy

    def run_eval() -> dict:
        with dist.gathered(policy):
            return evaluate(policy, tokenizer, task, rewards, n=cfg.eval_size, max_new_tokens=cfg.max_new_tokens,
                            progress=cfg.progress and main, dist=dist)

    dist.barrier()  # every process has checked the run directory before rank 0 writes to it
    if s.resume_from is not None:
        if main:
            ckpt.clean_partial(run_dir)
        state = ckpt.load_trainer_state(s.resume_from)
        dist.load_optimizer_state(optimized, optimizer, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if vm is not None and not vm.shared:
            dist.load_optimizer_state(vm.critic, vm.optimizer, state["critic_optimizer"])
            vm.scheduler.load_state_dict(state["critic_scheduler"])
        per_rank = state.get("rng_per_rank") or [state["rng"]]
        set_rng_state(per_rank[dist.rank] if len(per_rank) == dist.world else state["rng"])
        start_step, eval_before, evals = state["step"], state["eval_before"], state.get("evals", [])
        t_start -= state["wall_seconds"]
        if main:
            ckpt.trim_jsonl(run_dir / "metrics.jsonl", start_step)
            ckpt.trim_jsonl(run_dir / "samples.jsonl", start_step)
        log(f"resuming {run_dir} from step {start_step}")
    else:
        if main:
            run_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write_text(run_dir / "config.yaml", config_yaml)
        start_step = 0
        eval_before = run_eval()
        evals = [{"step": 0, **eval_before}]
    reporter = Reporter(run_dir, cfg.report_to, config=to_dict(cfg), start_step=start_step,
                        wandb_project=cfg.wandb_project) if main else None

    def save(step: int):
        # under FSDP the gathers are collectives: every process takes part, rank 0 writes
        rngs = dist.gather_objects(rng_state())  # every process's, in rank order
        state = {"step": step, "optimizer": dist.optimizer_state(optimized, optimizer), "scheduler": scheduler.state_dict(),
                 "rng": rngs[dist.rank], "rng_per_rank": rngs, "world_size": dist.world,
                 "eval_before": eval_before, "evals": evals, "wall_seconds": time.time() - t_start}
        state_dicts = {"": dist.full_state_dict(policy)}
        extra = {}
        if vm is not None:
            extra = {"value_head": vm.head} if vm.shared else {"critic": vm.critic}
            if not vm.shared:
                state["critic_optimizer"] = dist.optimizer_state(vm.critic, vm.optimizer)
                state["critic_scheduler"] = vm.scheduler.state_dict()
                state_dicts["critic"] = dist.full_state_dict(vm.critic)
        if main:
            ckpt.save_checkpoint(run_dir, step, policy, tokenizer, state, config_yaml, cfg.keep_checkpoints, extra,
                                 state_dicts)
        dist.barrier()

    # --- the loop ----------------------------------------------------------------------------
    bar = Progress(cfg, start_step, log) if main else None
    for step in range(start_step + 1, cfg.steps + 1):
        metrics, batch = train_step(step, policy, s.reference, tokenizer, task, rewards, optimizer, cfg, vm,
                                    s.routing, s.sampler, dist, s.train_model)
        scheduler.step()
        if vm is not None and vm.scheduler is not None:
            vm.scheduler.step()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            ev = run_eval()
            metrics["eval/accuracy"] = ev["accuracy"]
            evals.append({"step": step, **ev})
        if main:
            reporter.log(metrics)
            ckpt.append_jsonl(run_dir / "samples.jsonl", samples_rows(step, batch, cfg.group_size, cfg.samples_per_step))
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            save(step)
        if main:
            bar.update(metrics)
    if main:
        bar.close()

    eval_after = run_eval()
    if not evals or evals[-1]["step"] != cfg.steps:
        evals.append({"step": cfg.steps, **eval_after})
    last = ckpt.latest_checkpoint(run_dir)
    summary = {
        "algorithm": cfg.algorithm,
        "model": cfg.model,
        "task": cfg.dataset or cfg.task,
        "steps": cfg.steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "evals": evals,
        "wall_seconds": time.time() - t_start,
        "final_checkpoint": str(last) if last else None,
        **({"world_size": dist.world, "parallel": dist.parallel} if dist.enabled else {}),
    }
    if main:
        ckpt.atomic_write_text(run_dir / "summary.json", json.dumps(ckpt.json_clean(summary), indent=2) + "\n")
        reporter.summary({"eval_before/accuracy": eval_before["accuracy"], "eval_after/accuracy": eval_after["accuracy"]})
        reporter.close()
    return summary
