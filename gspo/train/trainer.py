"""The training loop: rollout → score → advantages → minibatch updates, one step at a time.

    from gspo.train.trainer import train
    summary = train(TrainConfig(algorithm="gspo", steps=60))   # summary["eval_after"]["accuracy"]

`train` reads top to bottom: build the run (gspo.train.run: every input checked before anything is
written) → start it, or restore it from its checkpoint → `train_step` for each step →
evaluate again → summary. `train_step(run, step)` can be called alone: sample a group per
prompt (`rollout`), score it (`score`), get the old policy's log-probs and the advantages
(`prepare`, gspo.train.batch), then `update` over `num_minibatches` minibatches for `epochs` passes. An update
`accumulate`s a `minibatch_loss` per micro-batch (gspo.models.logprobs.passes, within
--micro-batch-tokens) and takes one `optimizer_step` of each trainable. All but the first
minibatch of the first epoch are off-policy: that is where the ratios move and clipping acts.

Algorithms differ in the loss (gspo.algo.losses) and, for PPO, in the run's critic (gspo.train.critic),
a plug-in every run holds (NoCritic for the others), so the loop has no PPO branch: the
critic gives `prepare` its advantages (GAE over its values rather than group-relative),
adds its values to an update's forward and its term to the loss, and its states to
checkpoints; a separate critic is a second trainable (gspo.train.optim.Trainable) that every
update steps next to the policy's. MoE models likewise: the run's routing (gspo.models.moe;
NO_ROUTING for a dense model, recording nothing) records or replays the experts of every
forward and adds drift metrics and the balance loss. With an environment (--env, or the
task's own) a rollout is a group of multi-turn episodes (gspo.sampling.episodes): the same batch,
whose environment tokens are context only. Under torchrun every process runs this loop on
its share of the prompts; the global-batch bookkeeping shows up only as `dist` calls, the
identity in one process (gspo.processes.distributed, gspo.processes.parallel, gspo.algo.metrics). A step's row of
metrics.jsonl is gspo.train.steplog's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from pathlib import Path
from typing import NamedTuple

import torch

from gspo.agents.side import sampling_side
from gspo.algo.aggregation import agg_count
from gspo.algo.corrections import weight_collapse
from gspo.algo.losses import policy_loss
from gspo.algo.metrics import Max, Mean, combine, reduce_across
from gspo.config import TrainConfig, to_dict
from gspo.config.yamlfile import load_yaml
from gspo.io.files import append_jsonl, atomic_write_text, json_clean
from gspo.io.reporting import ProgressBar, Reporter, samples_rows, warn
from gspo.io.words import plural
from gspo.models.logprobs import MicroBatch, Split, passes
from gspo.processes import distributed, parallel
from gspo.processes.threads import restored
from gspo.rewards.builtin import TrainerState
from gspo.sampling.episodes import EpisodeSpec
from gspo.sampling.pipeline import Pipeline, make_pipeline, serve_rank
from gspo.sampling.produce import step_generator
from gspo.sampling.vllm_server import ServerError, ServerSampler
from gspo.tasks.scoring import RewardError
from gspo.train import checkpoint as ckpt
from gspo.train.batch import Batch, expert_load, prepare
from gspo.train.evaluation import EvalOptions, evaluate
from gspo.train.fingerprint import changed_since
from gspo.train.integrity import Watch, check_ratio, check_tokens, first_minibatch
from gspo.train.lifecycle import Guard, Interrupted
from gspo.train.plan import describe, plan
from gspo.train.run import AlreadyComplete, Run, build_run
from gspo.train.steplog import step_row

Tensor = torch.Tensor


class Totals(NamedTuple):
    """What a global minibatch's loss averages over: its aggregation count (gspo.algo.aggregation.
    agg_count) and its completion tokens, summed over processes."""

    agg: float
    tokens: float


# ----------------------------------------------------------------------------------------------
# The loop
# ----------------------------------------------------------------------------------------------


def train(cfg: TrainConfig=None, *, resume=None, log=print, inputs=None, callbacks=(), keep=None) -> dict:
    """Train a policy; returns the summary (also written to summary.json in the run directory).

    resume: a run directory to continue from its newest checkpoint (or from step 0, if it was
    killed before its first) with its saved configuration; `cfg` may then change the options
    that are safe to change (--steps, --device, logging, ...). A complete run is left as it is
    and its summary returned. Under torchrun every process calls this; rank 0 alone writes the
    run directory and logs. SIGINT/SIGTERM stop the run after the step under way with a
    checkpoint (gspo.train.lifecycle.Interrupted). inputs: objects in place of names (gspo.train.run.Inputs);
    callbacks: `(step, metrics) -> bool`, True stops the run after that step (gspo.api.Trainer);
    keep: called with the finished run (gspo.api.Trainer keeps its trained policy). The run sets
    torch's CPU threads (gspo.processes.threads); this process's count is put back when it ends.
    """
    with restored():
        return _train_in_process(cfg, resume, log, inputs, callbacks, keep)


def _train_in_process(cfg: TrainConfig, resume, log, inputs, callbacks, keep) -> dict:
    t_start = time.time()
    if distributed.world_size_from_env() > 1:  # under torchrun the world's last --rollout-workers ranks sample
        saved = Path(resume or ".") / "config.yaml"
        asked = cfg if cfg is not None else load_yaml(saved) if resume is not None and saved.exists() else TrainConfig()
        if distributed.rollout_rank(asked.async_rl.rollout_workers) is not None:
            return serve_rank(asked.async_rl.rollout_workers, asked.run.device, sampling_side)
    try:
        run = build_run(cfg, resume, inputs)  # raises on any bad input; nothing written yet
    except AlreadyComplete as done:
        log(f"{Path(resume).absolute()}: the run is complete ({plural(done.summary['steps'], 'step')}); nothing to do "
            f"(for more steps: gspo train --resume {resume} --steps N)")
        return done.summary
    run.progress.t_start = t_start
    if run.resume_from is not None and run.dist.is_main and (why := changed_since(run.run_dir, run.cfg)):
        run.notes.append(f"--resume: {run.run_dir} {why}; it continues with this gspo and these files")
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
        if isinstance(e, ServerError):  # a server down, slow or restarted: the run continues where it was saved
            last = ckpt.latest_checkpoint(run.run_dir)
            where = "from its last checkpoint" if last is not None else "from the start (no checkpoint yet)"
            raise ServerError(f"{e}; continue {where} with: "
                              f"{distributed.command_line(['train', '--resume', str(run.run_dir)])}") from e
        raise
    finally:
        if run.pipeline is not None:
            run.pipeline.close()  # rollout workers stop, whatever ended the run
        if isinstance(run.sampler, ServerSampler):
            run.sampler.close()  # a server gspo started is stopped; the pushed weights are removed
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
        log(f"resuming {run.run_dir} from step {run.progress.start_step}")
        if run.progress.pending_dropped and main:
            warn(f"--resume: the checkpoint's {run.progress.pending_dropped} sampled batches "
                 "were split over another number of "
                 "processes; they are sampled again from its weights (less stale, within --max-staleness)")
    else:
        if main:
            ckpt.start_run(run)  # config.yaml; a restart (killed before its first checkpoint) drops its logs
        run.progress.eval_before = run_eval(run, log, "eval before")  # its progress logged off a terminal
        run.progress.evals = [{"step": 0, **run.progress.eval_before}]
    # rollout workers start here (the weights are the restored ones)
    run.pipeline = make_pipeline(run, run.run_dir, run.progress.pending, build=sampling_side)
    reporter = Reporter(run.run_dir, cfg.run.report_to, config=to_dict(cfg), start_step=run.progress.start_step,
                        wandb_project=cfg.run.wandb_project) if main else None
    bar = ProgressBar(cfg.run.progress, cfg.run.steps, run.progress.start_step, log,
                      f"gspo train ({cfg.loss.algorithm})") if main else None
    try:
        for step in range(run.progress.start_step + 1, cfg.run.steps + 1):
            metrics, batch = train_step(run, step)
            run.progress.steps_done = step
            if main:
                _guard_weights(run, step, metrics)
            for trainable in run.trainables:  # the policy's LR schedule, and a separate critic's
                trainable.scheduler.step()
            if cfg.eval.eval_every and cfg.eval.eval_size and step % cfg.eval.eval_every == 0 and step < cfg.run.steps:
                spent = run.progress.eval_seconds
                run.pipeline.hold()  # a sampling thread (vllm-server) is done with the tokenizer the evaluation uses
                ev = run_eval(run)
                metrics["eval/accuracy"] = ev["accuracy"]
                metrics["time/eval_seconds"] = run.progress.eval_seconds - spent  # run_eval adds its wall time
                run.progress.evals.append({"step": step, **ev})
            if main:
                reporter.log(metrics)
                append_jsonl(run.run_dir / "samples.jsonl",
                             samples_rows(step, batch, cfg.run.samples_per_step, run.tokenizer))
            saved = (cfg.run.save_every and step % cfg.run.save_every == 0) or step == cfg.run.steps
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
    return finish(run, reporter, log)


def _guard_weights(run: Run, step: int, metrics: dict) -> None:
    """--rollout-is sequence weights that shrink the batch (gspo.algo.corrections.weight_collapse): said
    once a run, the first step it happens (the metrics show every step's)."""
    collapse = weight_collapse(metrics, run.cfg.corrections.rollout_is)
    if collapse and "weight_collapse" not in run.progress.warned:
        warn(f"step {step}: {collapse} (said once; is/weight_mean in metrics.jsonl is every step's)")
        run.progress.warned.add("weight_collapse")


def run_eval(run: Run, log=None, label: str = "eval") -> dict:
    """Held-out greedy accuracy of the current policy (sharded over processes); --eval-size 0: none.
    Its wall time adds to run.progress.eval_seconds. log: where its progress goes off a terminal, as
    `LABEL 256/500 problems (51%)  2 s` (gspo.train.evaluation; None: a bar on a terminal only, as for
    the evaluations within the run, whose accuracy the step's progress line shows)."""
    cfg = run.cfg
    if cfg.eval.eval_size == 0:
        return {"accuracy": None, "reward": None, "n": 0}
    t0 = time.time()
    try:
        return _evaluate(run, log, label)
    finally:
        run.progress.eval_seconds += time.time() - t0


def _evaluate(run: Run, log, label: str) -> dict:
    cfg = run.cfg
    with parallel.gathered(run.train_model, run.dist):  # the FSDP root: every parameter
        return evaluate(run.policy, run.tokenizer, run.task, run.rewards, EvalOptions(
            n=cfg.eval.eval_size, max_new_tokens=cfg.sampling.max_new_tokens, stop=run.stop_ids,
            progress=cfg.run.progress and run.dist.is_main, log=log, label=label,
            episode=EpisodeSpec.from_config(cfg, run.env, run.max_turns),
            trainer_state=TrainerState(run.progress.steps_done, cfg.run.steps),
            cuda_graphs=cfg.sampling.cuda_graphs), dist=run.dist)


def finish(run: Run, reporter: Reporter | None, log=None) -> dict:
    """The final evaluation (its progress through `log`) and the run's summary (summary.json)."""
    cfg, dist = run.cfg, run.dist
    eval_after = run_eval(run, log, "eval after")
    done = run.progress.steps_done
    if not run.progress.evals or run.progress.evals[-1]["step"] != done:
        run.progress.evals.append({"step": done, **eval_after})
    last = ckpt.latest_checkpoint(run.run_dir)
    summary = {
        "algorithm": cfg.loss.algorithm,
        "model": cfg.policy.model,
        "task": cfg.data.dataset or cfg.data.task,
        "steps": done,
        **({"stopped_early": True} if done < cfg.run.steps else {}),
        "eval_before": run.progress.eval_before,
        "eval_after": eval_after,
        "evals": run.progress.evals,
        "wall_seconds": time.time() - run.progress.t_start,
        "eval_seconds": run.progress.eval_seconds,  # of wall_seconds: the held-out evaluations (before, during, after)
        "final_checkpoint": str(last) if last else None,
        **({"world_size": dist.world, "parallel": dist.parallel} if dist.enabled else {}),
        "plan": plan(run),
    }
    if dist.is_main:
        atomic_write_text(run.run_dir / "summary.json", json.dumps(json_clean(summary), indent=2) + "\n")
        if eval_after["n"]:
            reporter.summary({"eval_before/accuracy": run.progress.eval_before["accuracy"],
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
    cfg = run.cfg
    t0 = time.perf_counter()
    if run.pipeline is None:  # train_step called alone: the trainer's process samples
        run.pipeline = Pipeline(run)
    produced, async_metrics = run.pipeline.take(step)  # sampled now, or K versions ago (gspo.sampling.pipeline)
    t_rollout = time.perf_counter() - t0
    batch = prepare(run, produced.rollout, produced.scored)
    checked = check_tokens(run, step, batch, produced)  # every trained token one a sampler drew, where it drew it
    t1 = time.perf_counter()
    t_prepare = t1 - t0 - t_rollout
    watch = first_minibatch(run, produced, step)  # on-policy: the first minibatch's log-probs against the sampler's
    history = update(run, batch, step_generator(cfg.run.seed, step, "minibatches"), watch)
    t_update = time.perf_counter() - t1
    metrics = step_row(run, step, batch, history)
    metrics.update(checked)
    if run.progress.clip is not None:  # --target-clip-frac: the range this step used, then the next step's
        metrics["clip/eps_low"], metrics["clip/eps_high"] = run.progress.clip.eps_low, run.progress.clip.eps_high
        run.progress.clip.update(metrics.get("clip/frac", float("nan")))
    t_step = time.perf_counter() - t0
    metrics.update({
        "time/rollout_seconds": t_rollout,
        "time/prepare_seconds": t_prepare,
        "time/update_seconds": t_update,
        "time/step_seconds": t_step,
        "time/tokens_per_second": float(run.dist.all_sum(batch.rollout.completion_mask.sum().double().cpu())) / t_step,
        **(async_metrics if cfg.async_rl.max_staleness or cfg.async_rl.rollout_workers
           or cfg.async_rl.drop_uniform_groups else {}),
    })
    return metrics, batch


# ----------------------------------------------------------------------------------------------
# The updates
# ----------------------------------------------------------------------------------------------


def update(run: Run, batch: Batch, generator: torch.Generator, watch: Watch | None = None) -> list[dict]:
    """`epochs` passes of clipped policy-gradient updates over `num_minibatches` minibatches
    (PPO: and value-loss updates of the critic on the same minibatches); returns each
    update's metrics, those of the global minibatch. `watch` (an on-policy batch): the first
    minibatch's log-probs are checked against the sampler's before its optimizer step
    (gspo.train.integrity.check_ratio; integrity/log_ratio_* in the first update's metrics).

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
    for _ in range(cfg.loss.epochs):
        order = torch.randperm(B_all, generator=generator)  # (B_all,) the same on every process
        minibatches = [g[(g >= lo) & (g < lo + B)] - lo for g in order.tensor_split(cfg.loss.num_minibatches)]
        counts = torch.tensor([[float(agg_count(mask[idx], cfg.loss.loss_agg)), float(mask[idx].sum())]
                               for idx in minibatches], dtype=torch.float64)  # (M, 2) what the losses average over
        totals = [Totals(*t) for t in dist.all_sum(counts).clamp(min=1).tolist()]  # the global minibatches' counts
        for idx, total in zip(minibatches, totals):
            first = not history and watch is not None  # on-policy: nothing has moved the weights yet
            batch.log_gap = torch.full((B,), float("nan"), device=mask.device) if first else None
            metrics = accumulate(run, batch, idx, total)
            worst, mean = check_ratio(run, batch, watch) if first else (float("nan"), float("nan"))  # weights unmoved
            batch.log_gap = None
            metrics["integrity/log_ratio_row_max"], metrics["integrity/log_ratio_mean"] = Max(worst), Max(mean)
            metrics.update(optimizer_step(run))
            history.append(metrics)
    return reduce_across(history, dist)


def accumulate(run: Run, batch: Batch, idx: Tensor, total: Totals) -> dict:
    """Forward and backward of rows `idx` (this process's part of a minibatch) in micro-batches;
    gradients accumulate (and are reduced across processes once, with the last). Every
    process runs as many passes (stand-ins of zero weight fill in): under FSDP each is collective."""
    cfg, dist, ro = run.cfg, run.dist, batch.rollout
    parts = Split(cfg.policy.micro_batch_tokens, 0, run.packed).groups(ro, idx)
    n = dist.max_int(len(parts))
    parts += [idx[:0]] * (n - len(parts))  # empty: a zero-weight stand-in row
    # the balance loss's f_e is the minibatch's: counted first when it runs in several passes
    load = expert_load(run, batch, parts) if run.routing.moe and cfg.moe.router_aux_loss_coef > 0 and n > 1 else None
    metrics = []
    for j, m in enumerate(passes(ro, parts, cfg.policy.micro_batch_tokens)):
        with contextlib.ExitStack() as no_sync:  # the policy's wrapper, and a separate critic's
            for trainable in run.trainables:
                no_sync.enter_context(parallel.no_sync(trainable.train, dist, j < n - 1))
            loss, critic_loss, mb_metrics = _loss(run, batch, m, total, load)
            for term in (loss, critic_loss):
                if term is not None:
                    (run.scaler.scale(term) if run.scaler is not None else term).backward()
        metrics.append(mb_metrics)
    return combine(metrics)


def minibatch_loss(run: Run, batch: Batch, idx: Tensor, total: Totals,
                   load: tuple[Tensor, float] | None = None) -> tuple[Tensor, Tensor | None, dict]:
    """The loss of rows `idx` of the batch (one micro-batch), scaled to its part of the global
    minibatch's loss (total: the global minibatch's aggregation and token counts):
    (policy loss, separate critic's loss or None, metrics). An empty `idx` runs one row with
    zero weight (every process must join every gradient reduction)."""
    return _loss(run, batch, next(passes(batch.rollout, [idx], run.cfg.policy.micro_batch_tokens)), total, load)


def _loss(run: Run, batch: Batch, m: MicroBatch, total: Totals,
          load: tuple[Tensor, float] | None) -> tuple[Tensor, Tensor | None, dict]:
    """`minibatch_loss` of micro-batch `m`. MoE: the forward records the experts the current
    router picks (`moe/drift`); with --routing-replay the old experts are forced for the ratio;
    `load`: the minibatch's expert counts for the balance loss (`expert_load`; None: this pass
    is the whole minibatch). PPO: the critic's values and its loss term (gspo.train.critic)."""
    cfg, critic = run.cfg, run.critic
    rows = batch.rows(m.idx, m.ps, m.ts)  # old_logp, advantages, ... of these rows and columns
    mask = m.rollout.completion_mask * m.live  # (b, T)
    agg_scale = float(agg_count(mask, cfg.loss.loss_agg)) * run.dist.world / total.agg  # its share of the global loss
    tok_scale = float(mask.sum()) * run.dist.world / total.tokens
    with run.routing.capture(rows.routing if cfg.moe.routing_replay else None,
                             keep_logits=cfg.moe.router_aux_loss_coef > 0) as cap, run.autocast():
        logp, hidden, entropy = run.train_model(dataclasses.replace(m.rollout, completion_mask=mask),
                                                temperature=cfg.sampling.temperature, packed=run.packed,
                                                hidden=critic.needs_hidden, entropy=True)  # (b, T), (b, T, H), (b, T)
        values = critic.forward(m.rollout, hidden, packed=run.packed)  # (b, T); None without a critic
    loss, metrics = policy_loss(
        logp, rows.old_logp, rows.advantages, mask, run.loss_options(), ref_logp=rows.ref_logp,
        is_weights=rows.is_weights, rollout_logp=rows.rollout_logp,
        opsm_delta=cfg.corrections.opsm_delta, max_len=cfg.sampling.max_new_tokens,
    )
    metrics["policy/entropy"] = Mean(entropy.sum() / mask.sum().clamp(min=1), mask.sum())
    if batch.log_gap is not None:  # the first on-policy minibatch: each row's mean |log π_train - log π_sampler|
        with torch.no_grad():
            gap = ((logp.detach().float() - rows.rollout_logp.float()).abs() * mask).sum(-1)  # (b,)
            n = mask.sum(-1)  # (b,) its trained tokens
            batch.log_gap[m.idx[n > 0]] = (gap / n.clamp(min=1))[n > 0].to(batch.log_gap.dtype)
    loss = loss * agg_scale
    aux, moe_metrics = run.routing.terms(cap, rows.routing, m.rollout.attention_mask * m.live,
                                         cfg.moe.router_aux_loss_coef, load=load, dist=run.dist)
    metrics.update(moe_metrics)
    loss, critic_loss, value_metrics = critic.loss(loss + aux * m.live, values, rows, mask, tok_scale)
    metrics.update(value_metrics)
    return loss, critic_loss, metrics


def optimizer_step(run: Run) -> dict:
    """After a minibatch's backward passes: for each trainable (the policy, and a separate
    critic), gradient clipping by global norm and the AdamW step (float16: unscaled first,
    skipped on overflow); the loss scaler updates once."""
    max_norm = run.cfg.optim.max_grad_norm if run.cfg.optim.max_grad_norm > 0 else float("inf")
    run.critic.before_step(run.dist)  # a shared value head: its gradients averaged over processes
    metrics = {trainable.metric: trainable.step(max_norm) for trainable in run.trainables}
    if run.scaler is not None:
        run.scaler.update()
    return metrics
