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

Left out here: multi-process training and value models.
"""

from __future__ import annotations

import dataclasses
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from gspo import checkpoint as ckpt
from gspo.advantages import group_advantages
from gspo.config import TrainConfig, load_yaml, resolve, to_dict
from gspo.evaluation import encode_prompts, evaluate
from gspo.losses import policy_loss
from gspo.models import load_policy
from gspo.rollout import Rollout, completion_logprobs, generate
from gspo.tasks import get_task

Tensor = torch.Tensor


@dataclass
class Batch:
    """A scored rollout batch, ready for updates. B = prompts_per_step · group_size."""

    rollout: Rollout
    rewards: Tensor  # (B,)
    advantages: Tensor  # (B,)
    old_logp: Tensor  # (B, T) log π_θold of the sampled tokens
    ref_logp: Tensor | None  # (B, T) log π_ref, when beta > 0
    prompts: list[str]  # (B,) prompt text per row
    answers: list[str]  # (B,)
    completions: list[str]  # (B,) decoded completions


# ----------------------------------------------------------------------------------------------
# The pieces of a step
# ----------------------------------------------------------------------------------------------


def rollout(policy, tokenizer, problems, cfg: TrainConfig, generator: torch.Generator) -> tuple[Rollout, list[str]]:
    """Sample cfg.group_size completions for each problem; returns the rollout and decoded texts."""
    prompts = encode_prompts(tokenizer, [p.prompt for p in problems])
    ro = generate(policy, prompts, group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                  temperature=cfg.temperature, top_p=cfg.top_p, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id, generator=generator)
    return ro, tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)


def score(task, problems, completions: list[str], group_size: int) -> Tensor:
    """Verifier reward of each completion; row b belongs to problem b // group_size. (B,)"""
    return torch.tensor([task.reward(c, problems[i // group_size]) for i, c in enumerate(completions)],
                        dtype=torch.float32)


@torch.no_grad()
def sequence_logprobs(model, ro: Rollout, temperature: float, batch_size: int) -> Tensor:
    """log π of every sampled token under `model`, in chunks of rows, without gradient. (B, T)"""
    out = []
    for idx in torch.arange(ro.prompt_ids.shape[0]).split(batch_size):
        sub = ro.select(idx)
        out.append(completion_logprobs(model, sub.input_ids, sub.attention_mask, sub.completion_mask,
                                       temperature=temperature))
    return torch.cat(out)


def update(policy, optimizer, batch: Batch, cfg: TrainConfig, generator: torch.Generator) -> list[dict]:
    """`epochs` passes of clipped policy-gradient updates over `num_minibatches` minibatches."""
    ro = batch.rollout
    B = ro.prompt_ids.shape[0]
    mb_size = B // cfg.num_minibatches
    policy.train()
    history = []
    for _ in range(cfg.epochs):
        order = torch.randperm(B, generator=generator, device=generator.device).cpu()  # (B,)
        for idx in order.split(mb_size):
            mb = ro.select(idx)
            logp = completion_logprobs(policy, mb.input_ids, mb.attention_mask, mb.completion_mask,
                                       temperature=cfg.temperature)  # (b, T)
            loss, metrics = policy_loss(
                cfg.algorithm, logp, batch.old_logp[idx], batch.advantages[idx], mb.completion_mask,
                clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.loss_agg, max_len=cfg.max_new_tokens,
                ref_logp=None if batch.ref_logp is None else batch.ref_logp[idx], beta=cfg.beta,
                kl_estimator=cfg.kl_estimator,
            )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
            metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))
            optimizer.step()
            history.append(metrics)
    return history


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


def train_step(step: int, policy, reference, tokenizer, task, optimizer, cfg: TrainConfig,
               generator: torch.Generator) -> tuple[dict, Batch]:
    """One step: rollout → score → advantages → old log-probs → updates. Returns (metrics, batch)."""
    t0 = time.perf_counter()
    problems = task.train_batch(step, cfg.prompts_per_step, cfg.seed)
    ro, completions = rollout(policy, tokenizer, problems, cfg, generator)
    t_rollout = time.perf_counter() - t0

    rewards = score(task, problems, completions, cfg.group_size)  # (B,)
    advantages = group_advantages(rewards, cfg.group_size, scale=cfg.adv_scale).to(ro.logp.device)  # (B,)
    mb_size = ro.prompt_ids.shape[0] // cfg.num_minibatches
    if cfg.old_logp == "sampling":
        old_logp = ro.logp  # (B, T) recorded while sampling (paper §5.4)
    else:
        old_logp = sequence_logprobs(policy, ro, cfg.temperature, mb_size)  # (B, T)
    ref_logp = sequence_logprobs(reference, ro, cfg.temperature, mb_size) if reference is not None else None
    batch = Batch(ro, rewards, advantages, old_logp, ref_logp,
                  [p.prompt for p in problems for _ in range(cfg.group_size)],
                  [p.answer for p in problems for _ in range(cfg.group_size)], completions)

    t1 = time.perf_counter()
    history = update(policy, optimizer, batch, cfg, generator)
    t_update = time.perf_counter() - t1

    groups = rewards.view(-1, cfg.group_size)
    lengths = ro.lengths.float()
    metrics = {
        "step": step,
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        "reward/flat_group_frac": float((groups.amax(1) == groups.amin(1)).float().mean()),
        **mean_metrics(history),
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": float(lengths.max()),
        "completion/truncated_frac": float(ro.truncated.float().mean()),
        "mismatch/token_abs": float(((ro.logp - old_logp).abs() * ro.completion_mask).sum()
                                    / ro.completion_mask.sum().clamp(min=1)) if cfg.old_logp == "recompute" else float("nan"),
        "lr": optimizer.param_groups[0]["lr"],
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
    import math

    def f(counter: int) -> float:
        k = counter + 1
        if cfg.warmup_steps and k <= cfg.warmup_steps:
            return k / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (k - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        return 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1.0 - progress

    return f


def rng_state(generator: torch.Generator) -> dict:
    return {"generator": generator.get_state(), "torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def set_rng_state(generator: torch.Generator, state: dict) -> None:
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def samples_rows(step: int, batch: Batch, n: int) -> list[dict]:
    return [{"step": step, "prompt": batch.prompts[i], "completion": batch.completions[i],
             "answer": batch.answers[i], "reward": float(batch.rewards[i]),
             "advantage": float(batch.advantages[i])} for i in range(min(n, len(batch.completions)))]


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


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train(cfg: TrainConfig, *, resume: str | Path | None = None, log=print) -> dict:
    """Train a policy; returns the summary (also written to summary.json in the run directory).

    resume: a run directory; training continues from its newest checkpoint with its saved
    configuration (`cfg` is then ignored).
    """
    t_start = time.time()
    if resume is not None:
        run_dir = Path(resume)
        if ckpt.latest_checkpoint(run_dir) is None:
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
    device = torch.device(cfg.device)

    # --- policy and task (from the newest checkpoint when resuming) --------------------------
    task = get_task(cfg.task)
    state = None
    if resume is not None:
        ckpt.clean_partial(run_dir)
        last = ckpt.latest_checkpoint(run_dir)
        state = ckpt.load_trainer_state(last)
        policy, tokenizer = load_policy(str(last), device=device)
    else:
        policy, tokenizer = load_policy(cfg.model, device=device)  # fails before anything is written
        run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.atomic_write_text(run_dir / "config.yaml", yaml.safe_dump(to_dict(cfg), sort_keys=False))
    reference = None
    if cfg.beta > 0:
        reference, _ = load_policy(cfg.model, device=device)  # the initial policy, frozen
        reference.eval().requires_grad_(False)

    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=cfg.adam_betas, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(cfg))
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    start_step = 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(generator, state["rng"])
        start_step = state["step"]
        eval_before = state["eval_before"]
        evals = state.get("evals", [])
        wall_before = state["wall_seconds"]
        ckpt.trim_jsonl(run_dir / "metrics.jsonl", start_step)
        ckpt.trim_jsonl(run_dir / "samples.jsonl", start_step)
        log(f"resuming {run_dir} from step {start_step}")
    else:
        eval_before = evaluate(policy, tokenizer, task, n=cfg.eval_size, max_new_tokens=cfg.max_new_tokens)
        evals = [{"step": 0, **eval_before}]
        wall_before = 0.0
    t_start -= wall_before

    def save(step: int):
        st = {"step": step, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
              "rng": rng_state(generator), "eval_before": eval_before, "evals": evals,
              "wall_seconds": time.time() - t_start}
        ckpt.save_checkpoint(run_dir, step, policy, tokenizer, st, yaml.safe_dump(to_dict(cfg), sort_keys=False),
                             cfg.keep_checkpoints)

    # --- the loop ----------------------------------------------------------------------------
    bar = Progress(cfg, start_step, log)
    for step in range(start_step + 1, cfg.steps + 1):
        metrics, batch = train_step(step, policy, reference, tokenizer, task, optimizer, cfg, generator)
        scheduler.step()
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            ev = evaluate(policy, tokenizer, task, n=cfg.eval_size, max_new_tokens=cfg.max_new_tokens)
            metrics["eval/accuracy"] = ev["accuracy"]
            evals.append({"step": step, **ev})
        ckpt.append_jsonl(run_dir / "metrics.jsonl", [metrics])
        ckpt.append_jsonl(run_dir / "samples.jsonl", samples_rows(step, batch, cfg.samples_per_step))
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            save(step)
        bar.update(metrics)
    bar.close()

    eval_after = evaluate(policy, tokenizer, task, n=cfg.eval_size, max_new_tokens=cfg.max_new_tokens)
    if not evals or evals[-1]["step"] != cfg.steps:
        evals.append({"step": cfg.steps, **eval_after})
    summary = {
        "algorithm": cfg.algorithm,
        "model": cfg.model,
        "task": cfg.task,
        "steps": cfg.steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "evals": evals,
        "wall_seconds": time.time() - t_start,
        "final_checkpoint": str(ckpt.latest_checkpoint(run_dir)) if ckpt.latest_checkpoint(run_dir) else None,
    }
    ckpt.atomic_write_text(run_dir / "summary.json", json.dumps(ckpt.json_clean(summary), indent=2) + "\n")
    return summary

