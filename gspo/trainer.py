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

Left out here: multi-process training.
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
from gspo.advantages import gae, group_advantages, masked_whiten
from gspo.config import TrainConfig, load_yaml, resolve, to_dict
from gspo.data import DataError
from gspo.evaluation import decode_completions, encode_prompts, evaluate
from gspo.losses import policy_loss
from gspo.models import DTYPES, add_lora, load_policy, resolve_device, unwrap
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
            routing: Routing | None = None) -> tuple[Rollout, list[str], list[list[int]]]:
    """Sample cfg.group_size completions per example with `sampler` (the policy, or its copy in
    --rollout-dtype); returns the rollout, texts and token ids. With `routing`, the experts used
    while sampling are recorded in the rollout."""
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in examples])
    ro = generate(sampler, prompts, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                  temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, generator=generator, min_new_tokens=cfg.min_new_tokens,
                  routing=routing)
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
           vm: ValueModel | None = None, routing: Routing | None = None) -> list[dict]:
    """`epochs` passes of clipped policy-gradient updates over `num_minibatches` minibatches
    (PPO: and clipped value-loss updates of the critic on the same minibatches).

    MoE (`routing`): every forward records the experts the current router picks; `moe/drift`
    compares them with the old policy's, and with --routing-replay the old experts are forced
    for the ratio's log-probs (`moe/drift_in_ratio` is then 0).
    """
    ro = batch.rollout
    B, T = ro.completion_mask.shape
    mb_size = B // cfg.num_minibatches
    params = [p for group in optimizer.param_groups for p in group["params"]]
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    policy.train()
    history = []
    for _ in range(cfg.epochs):
        order = torch.randperm(B, generator=generator)  # (B,)
        for idx in order.split(mb_size):
            mb = ro.select(idx)
            shared = vm is not None and vm.shared
            forced = batch.routing[idx] if (routing is not None and cfg.routing_replay) else None
            with routing.capture(forced, keep_logits=cfg.router_aux_loss_coef > 0) if routing is not None \
                    else contextlib.nullcontext() as cap:
                out = completion_logprobs(policy, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                          temperature=cfg.temperature, return_hidden=shared)
            logp, hidden = out if shared else (out, None)  # (b, T), (b, T, H)
            loss, metrics = policy_loss(
                cfg.algorithm, logp, batch.old_logp[idx], batch.advantages[idx], mb.completion_mask,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.loss_agg, max_len=cfg.max_new_tokens,
                ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx], beta=cfg.beta,
                kl_estimator=cfg.kl_estimator,
            )
            if routing is not None:
                aux, moe_metrics = moe_terms(cap, batch.routing[idx], mb.attention_mask, routing, cfg)
                loss = loss + aux
                metrics.update(moe_metrics)
            if vm is not None:
                values = vm.head(hidden) if shared else vm.critic(mb.input_ids, mb.attention_mask, T)  # (b, T)
                vloss, vmetrics = value_loss(values, batch.old_values[idx], batch.returns[idx], mb.completion_mask,
                                             clip_range=cfg.value_clip)
                metrics.update(vmetrics)
                if shared:
                    loss = loss + cfg.vf_coef * vloss  # one backward through the shared trunk
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
            optimizer.step()
            if vm is not None and not shared:
                vm.optimizer.zero_grad(set_to_none=True)
                vloss.backward()
                metrics["value/grad_norm"] = float(torch.nn.utils.clip_grad_norm_(vm.critic.parameters(), max_norm))
                vm.optimizer.step()
            history.append(metrics)
    return history


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


def mismatch_metrics(sampled: Tensor, recomputed: Tensor, mask: Tensor) -> dict[str, float]:
    """How far the sampling pass's log-probs are from the training forward's (precision gap):
    per token, and per response as the length-normalised log-ratio GSPO's s_i would see."""
    diff = (recomputed - sampled) * mask  # (B, T)
    n_tok = mask.sum(-1).clamp(min=1)  # (B,)
    seq = diff.sum(-1) / n_tok  # (B,) (1/|y|) Σ_t (log π_train - log π_sample)
    has = mask.sum(-1) > 0
    return {"mismatch/token_abs": float(diff.abs().sum() / mask.sum().clamp(min=1)),
            "mismatch/seq_log_ratio": float(seq[has].abs().mean()) if has.any() else 0.0}


def ppo_advantages(rewards: Tensor, old_values: Tensor, mask: Tensor, old_logp: Tensor, ref_logp: Tensor | None,
                   cfg: TrainConfig) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns (B, T) from the sequence reward at the last completion token,
    minus reward_kl_coef · (log π_old - log π_ref) on every token when that is on."""
    token_rewards = rewards.to(old_values.device)  # (B,) placed at the last token by gae()
    if cfg.reward_kl_coef > 0:
        last = (mask.sum(-1).long() - 1).clamp(min=0)  # (B,)
        token_rewards = -cfg.reward_kl_coef * (old_logp - ref_logp) * mask  # (B, T)
        token_rewards[torch.arange(mask.shape[0]), last] += rewards.to(old_values.device)
    adv, returns = gae(token_rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.gae_lambda)  # (B, T)
    if cfg.whiten_advantages:
        adv = masked_whiten(adv, mask)
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
               sampler: Sampler | None = None) -> tuple[dict, Batch]:
    """One step: rollout → score → old log-probs → advantages → updates. Returns (metrics, batch).

    Randomness is a function of (seed, step): the sampling uniforms and the minibatch order
    come from generators made for this step (`step_generator`).
    """
    t0 = time.perf_counter()
    sampler = sampler or Sampler(policy)
    sampler.sync(policy)
    examples = task.train_batch(step, cfg.prompts_per_step, cfg.seed)
    ro, completions, completion_ids = rollout(sampler.model, tokenizer, examples, cfg,
                                              step_generator(cfg.seed, step, "sample"), sampler.routing)
    t_rollout = time.perf_counter() - t0

    rewards_t, parts = score(rewards, examples, completions, completion_ids, cfg.group_size)  # (B,)
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
        advantages, returns = ppo_advantages(rewards_t, old_values, ro.completion_mask, old_logp, ref_logp, cfg)
    else:
        advantages = group_advantages(rewards_t, cfg.group_size, scale=cfg.adv_scale).to(ro.logp.device)  # (B,)
    batch = Batch(ro, rewards_t, parts, advantages, old_logp, ref_logp, examples, completions, old_values, returns,
                  old_routing)

    t1 = time.perf_counter()
    history = update(policy, optimizer, batch, cfg, step_generator(cfg.seed, step, "minibatches"), vm, routing)
    t_update = time.perf_counter() - t1

    groups = rewards_t.view(-1, cfg.group_size)
    lengths = ro.lengths.float()
    mask = ro.completion_mask
    metrics = {
        "step": step,
        "reward/mean": float(rewards_t.mean()),
        "reward/std": float(rewards_t.std()) if rewards_t.numel() > 1 else 0.0,
        "reward/flat_group_frac": float((groups.amax(1) == groups.amin(1)).float().mean()),
        **{f"reward/{name}/mean": sum(v) / len(v) for name, v in parts.items()},
        **mean_metrics(history),
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": float(lengths.max()),
        "completion/truncated_frac": float(ro.truncated.float().mean()),
        **(mismatch_metrics(ro.logp, old_logp, mask) if cfg.old_logp == "recompute" else {}),
        "lr": optimizer.param_groups[0]["lr"],
        **({"value/mean": float((old_values * mask).sum() / mask.sum().clamp(min=1)),
            "value/explained_variance": explained_variance(old_values, returns, mask)} if vm is not None else {}),
        "time/rollout_seconds": t_rollout,
        "time/update_seconds": t_update,
        "time/step_seconds": time.perf_counter() - t0,
    }
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


def setup(cfg: TrainConfig, resume: str | Path | None) -> Setup:
    resume_from = None
    if resume is not None:
        run_dir = Path(resume)
        resume_from = ckpt.latest_checkpoint(run_dir)
        if resume_from is None:
            raise FileNotFoundError(f"{run_dir}: no checkpoint to resume from")
        cfg = dataclasses.replace(load_yaml(run_dir / "config.yaml"), output_dir=str(run_dir))
    cfg = resolve(cfg)
    run_dir = Path(cfg.output_dir)
    if resume is None and run_dir.exists() and any(run_dir.iterdir()):
        raise FileExistsError(f"{run_dir}: output directory exists and is not empty (use --resume {run_dir} to continue it)")
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    device = resolve_device(cfg.device)
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
    return Setup(cfg, run_dir, task, rewards, policy, reference, tokenizer, device, resume_from, vm, routing, sampler)


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, resume: str | Path | None = None, log=print) -> dict:
    """Train a policy; returns the summary (also written to summary.json in the run directory).

    resume: a run directory; training continues from its newest checkpoint with its saved
    configuration (`cfg` is then ignored).
    """
    t_start = time.time()
    s = setup(cfg, resume)  # raises on any bad input; nothing written yet
    cfg, run_dir, policy, tokenizer, task, rewards = s.cfg, s.run_dir, s.policy, s.tokenizer, s.task, s.rewards
    config_yaml = yaml.safe_dump(to_dict(cfg), sort_keys=False)

    vm = s.value_model
    optimizer, scheduler = make_optimizers(cfg, policy, vm)

    def run_eval() -> dict:
        return evaluate(policy, tokenizer, task, rewards, n=cfg.eval_size, max_new_tokens=cfg.max_new_tokens,
                        progress=cfg.progress)

    if s.resume_from is not None:
        ckpt.clean_partial(run_dir)
        state = ckpt.load_trainer_state(s.resume_from)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        if vm is not None and not vm.shared:
            vm.optimizer.load_state_dict(state["critic_optimizer"])
            vm.scheduler.load_state_dict(state["critic_scheduler"])
        set_rng_state(state["rng"])
        start_step, eval_before, evals = state["step"], state["eval_before"], state.get("evals", [])
        t_start -= state["wall_seconds"]
        ckpt.trim_jsonl(run_dir / "metrics.jsonl", start_step)
        ckpt.trim_jsonl(run_dir / "samples.jsonl", start_step)
        log(f"resuming {run_dir} from step {start_step}")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_text(run_dir / "config.yaml", config_yaml)
        start_step = 0
        eval_before = run_eval()
        evals = [{"step": 0, **eval_before}]
    reporter = Reporter(run_dir, cfg.report_to, config=to_dict(cfg), start_step=start_step,
                        wandb_project=cfg.wandb_project)

    def save(step: int):
        state = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), "eval_before": eval_before, "evals": evals,
                 "wall_seconds": time.time() - t_start}
        extra = {}
        if vm is not None:
            extra = {"value_head": vm.head} if vm.shared else {"critic": vm.critic}
            if not vm.shared:
                state["critic_optimizer"] = vm.optimizer.state_dict()
                state["critic_scheduler"] = vm.scheduler.state_dict()
        ckpt.save_checkpoint(run_dir, step, policy, tokenizer, state, config_yaml, cfg.keep_checkpoints, extra)

    # --- the loop ----------------------------------------------------------------------------
    bar = Progress(cfg, start_step, log)
    for step in range(start_step + 1, cfg.steps + 1):
        metrics, batch = train_step(step, policy, s.reference, tokenizer, task, rewards, optimizer, cfg, vm,
                                    s.routing, s.sampler)
        scheduler.step()
        if vm is not None and vm.scheduler is not None:
            vm.scheduler.step()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            ev = run_eval()
            metrics["eval/accuracy"] = ev["accuracy"]
            evals.append({"step": step, **ev})
        reporter.log(metrics)
        ckpt.append_jsonl(run_dir / "samples.jsonl", samples_rows(step, batch, cfg.group_size, cfg.samples_per_step))
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            save(step)
        bar.update(metrics)
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
    }
    ckpt.atomic_write_text(run_dir / "summary.json", json.dumps(ckpt.json_clean(summary), indent=2) + "\n")
    reporter.summary({"eval_before/accuracy": eval_before["accuracy"], "eval_after/accuracy": eval_after["accuracy"]})
    reporter.close()
    return summary
