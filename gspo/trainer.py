"""The training loop: rollout → score → advantages → minibatch updates, one step at a time.

    from gspo.trainer import train
    summary = train(TrainConfig(algorithm="gspo", steps=60))   # summary["eval_after"]["accuracy"]

`train` reads top to bottom: build the run (gspo.run: every input checked before anything is
written) → start it, or restore it from its checkpoint → `train_step` for each step →
evaluate again → summary. `train_step(run, step)` can be called alone: sample a group per
prompt (`rollout`), score it (`score`), get the old policy's log-probs and the advantages
(`prepare`, gspo.batch), then `update` over `num_minibatches` minibatches for `epochs` passes. An update
`accumulate`s a `minibatch_loss` per micro-batch (within --micro-batch-tokens) and takes one
`optimizer_step`. All but the first minibatch of the first epoch are off-policy: that is
where the ratios move and clipping acts.

PPO differs in two places only: GAE advantages over a learned value model
(gspo.value.ppo_advantages), and each update also trains the value model. MoE models add
drift metrics and Routing Replay (gspo.moe). With an environment (--env, or the task's own) a
rollout is a group of multi-turn episodes (gspo.episodes): the same batch, whose environment
tokens are context only. Under torchrun every process runs this loop on
its share of the prompts; the global-batch bookkeeping shows up only as `dist` calls, the
identity in one process (gspo.distributed, gspo.parallel, gspo.metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from pathlib import Path

import torch

from gspo import checkpoint as ckpt
from gspo import distributed, parallel
from gspo.batch import Batch, expert_load, prepare
from gspo.config import to_dict
from gspo.evaluation import evaluate
from gspo.losses import agg_count, policy_loss
from gspo.logprobs import micro_batches, trim
from gspo.metrics import Mean, combine, reduce_across, step_row
from gspo.moe import moe_terms
from gspo.plan import describe, plan
from gspo.reporting import Progress, Reporter, samples_rows, warn
from gspo.rewards import Reward, RewardError, TrainerState, score_completions
from gspo.episodes import Episodes, run_episodes
from gspo.rollout import Rollout, cut_at_stop_strings, decode_completions, encode_prompts, sampling_params
from gspo.lifecycle import Guard, Interrupted
from gspo.run import AlreadyComplete, Run, build_run
from gspo.value import value_loss

Tensor = torch.Tensor


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train(cfg=None, *, resume=None, log=print, inputs=None, callbacks=(), keep=None) -> dict:
    """Train a policy; returns the summary (also written to summary.json in the run directory).

    resume: a run directory to continue from its newest checkpoint (or from step 0, if it was
    killed before its first) with its saved configuration; `cfg` may then change the options
    that are safe to change (--steps, --device, logging, ...). A complete run is left as it is
    and its summary returned. Under torchrun every process calls this; rank 0 alone writes the
    run directory and logs. SIGINT/SIGTERM stop the run after the step under way with a
    checkpoint (gspo.lifecycle.Interrupted). inputs: objects in place of names (gspo.run.Inputs);
    callbacks: `(step, metrics) -> bool`, True stops the run after that step (gspo.api.Trainer);
    keep: called with the finished run (gspo.api.Trainer keeps its trained policy).
    """
    t_start = time.time()
    try:
        run = build_run(cfg, resume, inputs)  # raises on any bad input; nothing written yet
    except AlreadyComplete as done:
        log(f"{Path(resume).absolute()}: the run is complete ({done.summary['steps']} steps); nothing to do "
            f"(for more steps: gspo train --resume {resume} --steps N)")
        return done.summary
    run.t_start = t_start
    guard = Guard(run)  # one writer per run directory; signals stop at the next step's end
    try:
        summary = _train(run, guard, log if run.dist.is_main else (lambda *a, **k: None), callbacks)
    except BaseException as e:
        if not isinstance(e, Interrupted):
            guard.failed()
        run.dist.close(clean=False)
        if isinstance(e, RewardError) and ckpt.latest_checkpoint(run.run_dir) is not None:  # mid-run: resumable
            raise RewardError(f"{e}; fix it and continue with: "
                              f"{distributed.command_line(['train', '--resume', str(run.run_dir)])}") from e
        raise
    finally:
        guard.release()
    run.dist.close()
    if keep is not None:
        keep(run)
    return summary


def _train(run: Run, guard: Guard, log, callbacks=()) -> dict:
    cfg, dist, main = run.cfg, run.dist, run.dist.is_main
    for note in run.notes:
        warn(note)
    log(describe(plan(run), warnings=False))  # the resolved plan, once (its warnings are the notes above)
    dist.barrier()  # every process has checked the run directory before rank 0 writes to it
    if run.resume_from is not None:
        ckpt.restore_run(run)
        log(f"resuming {run.run_dir} from step {run.start_step}")
    else:
        if main:
            ckpt.start_run(run)  # config.yaml; a restart (killed before its first checkpoint) drops its logs
        run.eval_before = run_eval(run)
        run.evals = [{"step": 0, **run.eval_before}]
    reporter = Reporter(run.run_dir, cfg.report_to, config=to_dict(cfg), start_step=run.start_step,
                        wandb_project=cfg.wandb_project) if main else None
    bar = Progress(cfg, run.start_step, log) if main else None
    try:
        for step in range(run.start_step + 1, cfg.steps + 1):
            metrics, batch = train_step(run, step)
            run.steps_done = step
            run.scheduler.step()
            if run.value_model is not None and run.value_model.scheduler is not None:
                run.value_model.scheduler.step()
            if cfg.eval_every and cfg.eval_size and step % cfg.eval_every == 0 and step < cfg.steps:
                ev = run_eval(run)
                metrics["eval/accuracy"] = ev["accuracy"]
                run.evals.append({"step": step, **ev})
            if main:
                reporter.log(metrics)
                ckpt.append_jsonl(run.run_dir / "samples.jsonl", samples_rows(step, batch, cfg.samples_per_step, run.tokenizer))
            saved = (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps
            if saved:
                ckpt.save_run(run, step)
            if main:
                bar.update(metrics)
            stop = any([bool(on_step_end(step, metrics)) for on_step_end in callbacks])
            if guard.check(step, saved, stop):  # a signal raises Interrupted; a callback's stop ends the loop
                log(f"stopped by a callback after step {step}")
                break
    except BaseException:
        if main:
            reporter.close()  # TensorBoard flushed, W&B finished: the curves so far are kept
        raise
    finally:
        if main:
            bar.close()
    return finish(run, reporter)


def run_eval(run: Run) -> dict:
    """Held-out greedy accuracy of the current policy (sharded over processes); --eval-size 0: none."""
    cfg = run.cfg
    if cfg.eval_size == 0:
        return {"accuracy": None, "reward": None, "n": 0}
    with parallel.gathered(run.train_model, run.dist):  # the FSDP root: every parameter
        return evaluate(run.policy, run.tokenizer, run.task, run.rewards, n=cfg.eval_size, stop=run.stop_ids,
                        max_prompt_length=cfg.max_prompt_length, stop_strings=cfg.stop_string,
                        max_new_tokens=cfg.max_new_tokens, progress=cfg.progress and run.dist.is_main, dist=run.dist,
                        env=run.env, max_turns=run.max_turns, max_episode_tokens=cfg.max_episode_tokens,
                        trainer_state=TrainerState(run.steps_done, cfg.steps))


def finish(run: Run, reporter: Reporter | None) -> dict:
    """The final evaluation and the run's summary (summary.json)."""
    cfg, dist = run.cfg, run.dist
    eval_after = run_eval(run)
    done = run.steps_done
    if not run.evals or run.evals[-1]["step"] != done:
        run.evals.append({"step": done, **eval_after})
    last = ckpt.latest_checkpoint(run.run_dir)
    summary = {
        "algorithm": cfg.algorithm,
        "model": cfg.model,
        "task": cfg.dataset or cfg.task,
        "steps": done,
        **({"stopped_early": True} if done < cfg.steps else {}),
        "eval_before": run.eval_before,
        "eval_after": eval_after,
        "evals": run.evals,
        "wall_seconds": time.time() - run.t_start,
        "final_checkpoint": str(last) if last else None,
        **({"world_size": dist.world, "parallel": dist.parallel} if dist.enabled else {}),
        "plan": plan(run),
    }
    if dist.is_main:
        ckpt.atomic_write_text(run.run_dir / "summary.json", json.dumps(ckpt.json_clean(summary), indent=2) + "\n")
        if eval_after["n"]:
            reporter.summary({"eval_before/accuracy": run.eval_before["accuracy"],
                              "eval_after/accuracy": eval_after["accuracy"]})
        reporter.close()
    return summary


# ----------------------------------------------------------------------------------------------
# One step
# ----------------------------------------------------------------------------------------------


def train_step(run: Run, step: int) -> tuple[dict, Batch]:
    """One step: rollout → score → old log-probs and advantages → updates. Returns (metrics, batch).

    Randomness is a function of (seed, step): the sampling uniforms and the minibatch order
    come from generators made for this step (`step_generator`). Several processes: this
    process samples and scores its contiguous share of the step's prompts; `batch` holds its
    rows; advantages and metrics are those of the global batch.
    """
    cfg, dist = run.cfg, run.dist
    t0 = time.perf_counter()
    n = cfg.prompts_per_step // dist.world
    examples = run.task.train_batch(step, cfg.prompts_per_step, cfg.seed)[dist.rank * n:(dist.rank + 1) * n]
    ro, completions, completion_ids, episodes = rollout(run, examples, step)
    t_rollout = time.perf_counter() - t0
    rewards, parts = score(run.rewards, examples, completions, completion_ids, cfg.group_size, episodes,
                           TrainerState(step - 1, cfg.steps))  # (B,)
    batch = prepare(run, ro, rewards=rewards, parts=parts, examples=examples, completions=completions,
                    episodes=episodes)
    t1 = time.perf_counter()
    history = update(run, batch, step_generator(cfg.seed, step, "minibatches"))
    t_update = time.perf_counter() - t1
    metrics = step_row(run, step, batch, history)
    metrics.update({
        "time/rollout_seconds": t_rollout,
        "time/update_seconds": t_update,
        "time/step_seconds": time.perf_counter() - t0,
    })
    return metrics, batch


def step_generator(seed: int, step: int, purpose: str) -> torch.Generator:
    """A CPU generator that is a function of (seed, step, purpose) alone: a resumed run, or a
    run split across processes, draws the same numbers for the same step."""
    digest = hashlib.sha256(f"gspo-{seed}-{step}-{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def rollout(run: Run, examples: list, step: int) -> tuple[Rollout, list[str], list[list[int]], Episodes | None]:
    """Sample cfg.group_size completions per example with the run's sampler, from the current
    policy's weights; returns the rollout, the texts and token ids the rewards score, and (with
    an environment) the episodes (gspo.episodes: the texts are then each episode's final model
    turn). Several processes: these are rows (offset, total) of the global batch (see
    gspo.rollout.generate)."""
    cfg, dist, G = run.cfg, run.dist, run.cfg.group_size
    params = sampling_params(run.tokenizer, stop=run.stop_ids, group_size=G, max_new_tokens=cfg.max_new_tokens,
                             temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                             min_new_tokens=cfg.min_new_tokens)
    run.sampler.sync(run.policy)
    rows = (dist.rank * len(examples) * G, cfg.prompts_per_step * G)
    if run.env is not None:
        ro, ep = run_episodes(run.sampler, run.tokenizer, examples, run.env, params, max_turns=run.max_turns,
                              max_tokens=cfg.max_episode_tokens, rows=rows, stop_strings=cfg.stop_string,
                              max_prompt_length=cfg.max_prompt_length, dist=dist,
                              generator_for=lambda turn: step_generator(cfg.seed, step, f"sample-turn-{turn}"
                                                                        if turn else "sample"))
        run.sampler.end_rollout()  # vLLM: sleeps after the last turn's sample
        return ro, ep.final_texts, ep.final_ids, ep
    prompts = encode_prompts(run.tokenizer, [ex.prompt for ex in examples], cfg.max_prompt_length)
    ro = run.sampler.sample(prompts, params, generator=step_generator(cfg.seed, step, "sample"), rows=rows)
    run.sampler.end_rollout()  # vLLM: sleeps after the last sample
    ro = cut_at_stop_strings(ro, run.tokenizer, cfg.stop_string)
    texts, ids = decode_completions(run.tokenizer, ro)
    return ro, texts, ids, None


def score(rewards: list[Reward], examples, completions: list[str], completion_ids, group_size: int,
          episodes: Episodes | None = None, trainer_state: TrainerState | None = None):
    """Weighted reward of each completion (B,) and each reward's values; row b is example b // G.
    Episodes: plus the environment's rewards over the episode (its own part, `env`). Rewards get
    `trainer_state` (the steps done and the run's steps), as TRL's do."""
    total, parts = score_completions(rewards, examples, completions, completion_ids, group_size, trainer_state)
    total = torch.tensor(total, dtype=torch.float32)
    if episodes is not None:
        parts["env"] = episodes.env_reward.tolist()
        total = total + episodes.env_reward
    return total, parts


# ----------------------------------------------------------------------------------------------
# The updates
# ----------------------------------------------------------------------------------------------


def update(run: Run, batch: Batch, generator: torch.Generator) -> list[dict]:
    """`epochs` passes of clipped policy-gradient updates over `num_minibatches` minibatches
    (PPO: and value-loss updates of the critic on the same minibatches); returns each
    update's metrics, those of the global minibatch.

    Each minibatch runs in micro-batches within the token budget, its loss scaled so that the
    accumulated gradient is that of the whole minibatch's loss. Several processes: the
    minibatches are those of the global batch (one permutation of all processes' rows); each
    process takes its rows of each (possibly none) and scales its loss by the global counts,
    so that the averaged gradient is that of the global minibatch's loss.
    """
    cfg, dist = run.cfg, run.dist
    mask = batch.rollout.completion_mask  # (B, T)
    B = mask.shape[0]
    B_all, lo = B * dist.world, B * dist.rank  # this process holds global rows lo .. lo+B-1
    run.train_model.train()
    history = []
    for _ in range(cfg.epochs):
        order = torch.randperm(B_all, generator=generator)  # (B_all,) the same on every process
        minibatches = [g[(g >= lo) & (g < lo + B)] - lo for g in order.split(B_all // cfg.num_minibatches)]
        counts = torch.tensor([[float(agg_count(mask[idx], cfg.loss_agg)), float(mask[idx].sum())]
                               for idx in minibatches], dtype=torch.float64)  # (M, 2) what the losses average over
        totals = dist.all_sum(counts).clamp(min=1).tolist()  # (M, 2) the global minibatches' counts
        for idx, total in zip(minibatches, totals):
            metrics = accumulate(run, batch, idx, total)
            metrics.update(optimizer_step(run))
            history.append(metrics)
    return reduce_across(history, dist)


def accumulate(run: Run, batch: Batch, idx: Tensor, total: list[float]) -> dict:
    """Forward and backward of rows `idx` (this process's part of a minibatch) in micro-batches;
    gradients accumulate (and are reduced across processes once, with the last). Every
    process runs as many passes (stand-ins of zero weight fill in): under FSDP each is collective."""
    cfg, dist = run.cfg, run.dist
    parts = micro_batches(batch.rollout, idx, cfg.micro_batch_tokens, run.packed) if len(idx) else [idx]
    n = dist.max_int(len(parts))
    parts += [idx[:0]] * (n - len(parts))  # empty: a zero-weight stand-in row
    # the balance loss's f_e is the minibatch's: counted first when it runs in several passes
    load = expert_load(run, batch, parts) if run.routing is not None and cfg.router_aux_loss_coef > 0 and n > 1 \
        else None
    metrics = []
    for j, part in enumerate(parts):
        last = j == n - 1
        critic = run.value_model.critic_train if run.value_model is not None and not run.value_model.shared else None
        with parallel.no_sync(run.train_model, dist, not last), \
                parallel.no_sync(critic, dist, not last and critic is not None):
            loss, critic_loss, m = minibatch_loss(run, batch, part, total, load)
            for term in (loss, critic_loss):
                if term is not None:
                    (run.scaler.scale(term) if run.scaler is not None else term).backward()
        metrics.append(m)
    return combine(metrics)


def minibatch_loss(run: Run, batch: Batch, idx: Tensor, total: list[float],
                   load: tuple[Tensor, float] | None = None) -> tuple[Tensor, Tensor | None, dict]:
    """The loss of rows `idx` of the batch (one micro-batch), scaled to its part of the global
    minibatch's loss (total: the global minibatch's (aggregation count, token count)):
    (policy loss, separate critic's loss or None, metrics).

    An empty `idx` runs one row with zero weight (every process must join every gradient
    reduction). MoE: the forward records the experts the current router picks (`moe/drift`);
    with --routing-replay the old experts are forced for the ratio; `load`: the minibatch's
    expert counts for the balance loss (`expert_load`; None: this pass is the whole minibatch).
    """
    cfg, routing, vm = run.cfg, run.routing, run.value_model
    live = 1.0 if len(idx) else 0.0
    idx = idx if len(idx) else torch.zeros(1, dtype=torch.long)  # a zero-weight stand-in row
    mb, ps, ts = trim(batch.rollout.select(idx)) if cfg.micro_batch_tokens > 0 else \
        (batch.rollout.select(idx), slice(None), slice(None))
    rows = batch.rows(idx, ps, ts)  # old_logp, advantages, ... of these rows and columns
    mask = mb.completion_mask * live  # (b, T)
    agg_scale = float(agg_count(mask, cfg.loss_agg)) * run.dist.world / total[0]  # its share of the global loss
    tok_scale = float(mask.sum()) * run.dist.world / total[1]
    shared = vm is not None and vm.shared
    with routing.capture(rows["routing"] if cfg.routing_replay else None, keep_logits=cfg.router_aux_loss_coef > 0) \
            if routing is not None else contextlib.nullcontext() as cap, run.autocast():
        logp, hidden, entropy = run.train_model(dataclasses.replace(mb, completion_mask=mask),
                                                temperature=cfg.temperature, packed=run.packed, hidden=shared,
                                                entropy=True)  # (b, T), (b, T, H), (b, T)
        values = vm.forward(mb, hidden, packed=run.packed) if vm is not None else None  # (b, T)
    loss, metrics = policy_loss(
        cfg.algorithm, logp, rows["old_logp"], rows["advantages"], mask,
        clip_low=cfg.clip_low, clip_high=cfg.clip_high, agg=cfg.loss_agg, max_len=cfg.max_new_tokens,
        ref_logp=rows["ref_logp"], beta=cfg.beta, kl_estimator=cfg.kl_estimator, tau_pos=cfg.sapo_tau_pos,
        tau_neg=cfg.sapo_tau_neg, is_weights=rows["is_weights"], rollout_logp=rows["rollout_logp"],
        opsm_delta=cfg.opsm_delta,
    )
    metrics["policy/entropy"] = Mean(entropy.sum() / mask.sum().clamp(min=1), mask.sum())
    loss = loss * agg_scale
    if routing is not None:
        aux, moe_metrics = moe_terms(cap, rows["routing"], mb.attention_mask * live, routing.top_k,
                                     cfg.router_aux_loss_coef, load=load, all_sum=run.dist.all_sum,
                                     world=run.dist.world)
        loss = loss + aux * live
        metrics.update(moe_metrics)
    if vm is None:
        return loss, None, metrics
    vloss, vmetrics = value_loss(values, rows["old_values"], rows["returns"], mask, clip_range=cfg.value_clip)
    metrics.update(vmetrics)
    if shared:  # one backward through the shared trunk
        return loss + cfg.vf_coef * (vloss * tok_scale), None, metrics
    return loss, vloss * tok_scale, metrics


def optimizer_step(run: Run) -> dict:
    """After a minibatch's backward passes: gradient clipping by global norm and the AdamW
    step (float16: unscaled first, skipped on overflow), for the policy and a separate critic."""
    cfg, vm, scaler = run.cfg, run.value_model, run.scaler
    max_norm = cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf")
    if vm is not None and vm.shared:
        run.dist.average_grads(vm.head.parameters())  # the replicated head no wrapper owns
    steps = [(run.optimizer, "grad_norm")]
    if vm is not None and not vm.shared:
        steps.append((vm.optimizer, "value/grad_norm"))
    metrics = {}
    for optimizer, name in steps:
        if scaler is not None:
            scaler.unscale_(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        metrics[name] = Mean(parallel.clip_grad_norm(params, max_norm))  # the same on every process
        (scaler.step(optimizer) if scaler is not None else optimizer.step())
        optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.update()
    return metrics
