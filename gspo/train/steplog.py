"""A step's row of metrics.jsonl: batch-level values over the global batch, then the updates' means.

    from gspo.train.steplog import step_row
    row = step_row(run, step, batch, history)   # {"step", "reward/mean", ..., "lr", "value/mean"?}
    mismatch(sampled_logp, old_logp, mask)      # mismatch/token_abs, mismatch/seq_log_ratio

Rewards, completion lengths, the sampler/trainer mismatch, rollout-correction statistics,
multi-turn episodes' statistics, the step's means of the per-update metrics (gspo.algo.metrics),
the learning rate and the critic's own (gspo.train.critic: none without one).
"""

from __future__ import annotations

import torch

from gspo.algo.metrics import step_means
from gspo.train.batch import survivors
from gspo.train.run import Run

Tensor = torch.Tensor


def step_row(run: Run, step: int, batch, history: list[dict]) -> dict:
    """The step's row of metrics.jsonl (without timings), over the global batch: batch-level
    values gathered from every process, then the step's means of the updates' `history`.
    run: a gspo.train.run.Run; batch: a gspo.train.batch.Batch."""
    cfg, dist, ro = run.cfg, run.dist, episode_rows(batch)
    lengths = dist.gather(ro.lengths.float())  # (B_all,)
    all_parts = {name: dist.gather(torch.tensor(v, dtype=torch.float64)) for name, v in batch.reward_parts.items()}
    metrics = {
        "step": step,
        **reward_stats(batch.all_rewards, survivors(batch.episodes, dist), cfg.sampling.group_size),
        # None rewards left out; a reward's own metrics (`judge/unparsed_frac`, apply_rewards) under their names
        **{name if "/" in name else f"reward/{name}/mean": float(v.nanmean()) for name, v in all_parts.items()},
        **step_means(history),
        "completion/mean_length": float(lengths.mean()),
        "completion/max_length": float(lengths.max()),
        "completion/truncated_frac": float(dist.gather(ro.truncated.float()).mean()),
        **(mismatch(batch.rollout.logp, batch.old_logp, batch.rollout.completion_mask, dist.gather)
           if cfg.loss.old_logp == "recompute" else {}),
        **{k: float(v) for k, v in (batch.is_metrics or {}).items()},
        **{k: float(v) for k, v in (batch.distill_metrics or {}).items()},
        "lr": run.optimizer.param_groups[0]["lr"],
    }
    if batch.episodes is not None:
        metrics.update(episode_metrics(batch, run.max_turns, dist))
    metrics.update(run.critic.step_metrics(batch, dist))  # PPO: value/mean, value/explained_variance
    return metrics


def reward_stats(rewards: Tensor, valid: Tensor | None, group_size: int) -> dict[str, float]:
    """reward/mean, reward/std and reward/flat_group_frac over the global batch's rewards (B_all,),
    counting only `valid` rows (an agent's episodes that did not fail; None: all): a group is
    flat when its valid rewards are all equal or fewer than 2 are valid."""
    if valid is None:
        groups = rewards.view(-1, group_size)  # (N_all, G)
        return {"reward/mean": float(rewards.mean()),
                "reward/std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
                "reward/flat_group_frac": float((groups.amax(1) == groups.amin(1)).float().mean())}
    kept, groups, ok = rewards[valid], rewards.view(-1, group_size), valid.view(-1, group_size)  # (n,), (N, G) x2
    high = torch.where(ok, groups, -torch.inf).amax(1)  # (N_all,)
    low = torch.where(ok, groups, torch.inf).amin(1)
    flat = (high == low) | (ok.sum(1) < 2)
    return {"reward/mean": float(kept.mean()) if kept.numel() else 0.0,
            "reward/std": float(kept.std()) if kept.numel() > 1 else 0.0,
            "reward/flat_group_frac": float(flat.float().mean())}


def episode_rows(batch):
    """The batch's rollout, its rows those of its episodes (rows B.., an agent's later sequences,
    left out): what the step's completion/* metrics describe."""
    ro, B = batch.rollout, batch.rewards.shape[0]
    return ro if batch.episode_of is None else ro.map(lambda t: t[:B])


def mismatch(sampled: Tensor, recomputed: Tensor, mask: Tensor, gather=None) -> dict[str, float]:
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


def episode_metrics(batch, max_turns: int, dist) -> dict[str, float]:
    """Multi-turn episodes over the global batch: turns, tool calls and the share that failed,
    the share of episodes ended by the turn limit, model and environment tokens per episode, and
    the environment's mean reward at each turn (over the episodes that reached it)."""
    ep, ro, of = batch.episodes, batch.rollout, batch.episode_of
    tokens = torch.stack([ro.completion_mask.sum(1), ro.env_mask.sum(1)], 1).cpu().double()  # (B + E, 2)
    if of is not None:  # an agent's later sequences: their tokens counted in their episode's
        tokens = torch.zeros(len(ep.turns), 2, dtype=torch.float64).index_add(0, of, tokens)
    rows = torch.cat([torch.stack([ep.turns, ep.tool_calls, ep.tool_errors, ep.turn_limit], 1).double(),
                      tokens], 1)  # (B, 6)
    turns, calls, errors, limited, model_tokens, env_tokens = dist.gather(rows).unbind(1)  # (B_all,) each
    by_turn = torch.full((len(ep.turn_rewards), max_turns), float("nan"), dtype=torch.float64)  # (B, K)
    for b, rewards in enumerate(ep.turn_rewards):
        by_turn[b, :len(rewards)] = torch.tensor(rewards, dtype=torch.float64)
    by_turn = dist.gather(by_turn)  # (B_all, K)
    return {
        "episode/turns": float(turns.mean()),
        "episode/tool_calls": float(calls.mean()),
        "episode/tool_error_rate": float(errors.sum() / calls.sum()) if calls.sum() > 0 else 0.0,
        "episode/turn_limit_frac": float(limited.mean()),
        "episode/model_tokens": float(model_tokens.mean()),
        "episode/env_tokens": float(env_tokens.mean()),
        **{f"episode/turn_{k + 1}_reward": float(by_turn[:, k].nanmean()) for k in range(max_turns)
           if not by_turn[:, k].isnan().all()},
        **(agent_metrics(ep, dist, batch.groups_dropped) if ep.agent is not None else {}),
    }


def agent_metrics(ep, dist, groups_dropped: int) -> dict[str, float]:
    """Agents (gspo.agents.runner) over the global batch: the share of failed episodes, the
    groups their failures left with fewer than 2 survivors (out of the loss, gspo.train.batch),
    the sequences per episode beyond the first (concurrent calls, forks, edited histories), the
    calls after an episode ended, the requests refused for want of the run's key, and the
    episodes cut at a deadline still running in the background (their threads)."""
    stats = ep.agent  # gspo.agents.runner.AgentStats
    rows = dist.gather(torch.stack([ep.failed, stats.extra_sequences], 1).double())  # (B_all, 2)
    counts = dist.gather(torch.tensor([[float(stats.late_calls), float(stats.refused), float(groups_dropped),
                                        float(getattr(stats, "left_behind", 0))]], dtype=torch.float64))  # (world, 4)
    return {"agent/failed_frac": float(rows[:, 0].mean()), "agent/groups_dropped": float(counts[:, 2].sum()),
            "agent/extra_sequences": float(rows[:, 1].mean()), "agent/late_calls": float(counts[:, 0].sum()),
            "agent/refused_requests": float(counts[:, 1].sum()), "agent/left_behind": float(counts[:, 3].sum())}
