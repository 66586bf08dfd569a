"""A scored rollout batch: everything the updates of one step read, per row, and how it is made.

    batch = prepare(run, rollout, Scored(rewards=r, parts=p, examples=ex, completions=texts))   # a Batch
    cols = batch.rows(idx, ps, ts)   # the per-row tensors of rows idx, cut to a trimmed micro-batch's columns

`prepare` adds to a scored rollout the old policy's log-probs, the reference's and the
advantages (by the run's estimator, gspo.algo.advantages.ESTIMATORS); the batch is read by
gspo.train.trainer's `minibatch_loss`, the metrics of the step and samples.jsonl. `expert_load` counts, for an
MoE balance loss split over micro-batches, the experts' load over the whole minibatch (a no-grad pass before the
minibatch's updates).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from gspo.algo.advantages import ESTIMATORS, AdvantageInputs, distill_advantages, distill_metrics, with_distill
from gspo.algo.corrections import rollout_is_weights, spread
from gspo.algo.losses import LOSSES
from gspo.algo.metrics import Max, reduce_across
from gspo.models.logprobs import Split, passes, token_logprobs
from gspo.models.moe import expert_counts
from gspo.models.sequences import Rollout
from gspo.processes import parallel
from gspo.sampling.episodes import Episodes
from gspo.tasks.scoring import Scored
from gspo.train.critic import estimator_name

if TYPE_CHECKING:
    from gspo.config import TrainConfig
    from gspo.models.moe import NoRouting, Routing
    from gspo.processes.distributed import Dist
    from gspo.train.critic import NoCritic
    from gspo.train.distill import Teachers

Tensor = torch.Tensor


class Trains(Protocol):
    """What preparing a batch reads of its run (a gspo.train.run.Run is one): the models its no-grad
    passes run, and how."""

    cfg: TrainConfig
    dist: Dist
    policy: torch.nn.Module
    reference: torch.nn.Module | None
    train_model: torch.nn.Module | None
    routing: Routing | NoRouting
    critic: NoCritic
    teachers: Teachers | None
    packed: bool
    max_turns: int

    def autocast(self): ...


@dataclass
class Rows:
    """A micro-batch's part of a Batch (`Batch.rows`): its rows, cut to its columns; None where
    the run computes none (no reference, no critic, no correction, a dense model)."""

    old_logp: Tensor | None  # (b, t)
    advantages: Tensor | None  # (b,) or (b, t)
    ref_logp: Tensor | None  # (b, t)
    old_values: Tensor | None  # (b, t)
    returns: Tensor | None  # (b, t)
    routing: Tensor | None  # (b, p+t, L, k) the experts each token used while sampling (MoE)
    is_weights: Tensor | None  # (b, t)
    rollout_logp: Tensor | None  # (b, t) the sampler's own log-probs


@dataclass
class Batch:
    """A scored rollout batch, ready for updates: this process's rows (B of B_all)."""

    rollout: Rollout
    rewards: Tensor  # (B,) weighted sum of all rewards
    all_rewards: Tensor  # (B_all,) every process's rewards, in rank order
    reward_parts: dict[str, list[float]]  # name -> (B,) each reward's values
    advantages: Tensor | None  # (B,) group-relative, or (B, T) from GAE (PPO); None until `prepare` sets them
    old_logp: Tensor | None  # (B, T) log π_θold of the sampled tokens
    ref_logp: Tensor | None  # (B, T) log π_ref, when beta > 0 or reward_kl_coef > 0
    examples: list  # (B / G,) the prompts' Examples
    completions: list[str]  # (B,) decoded completions
    old_values: Tensor | None = None  # (B, T) PPO: V_old(s_t) before the updates
    returns: Tensor | None = None  # (B, T) PPO: GAE returns, the value targets
    routing: Tensor | None = None  # (B, P+T, L, k) MoE: experts used under the old policy
    is_weights: Tensor | None = None  # (B, T) --rollout-is: π_old/π_rollout, truncated or masked
    is_metrics: dict | None = None  # their statistics over the global batch (gspo.algo.corrections)
    teacher_logp: Tensor | None = None  # (B, T) distillation: log π_teacher of the sampled tokens (0: no teacher)
    distill_metrics: dict | None = None  # distill/*, over the global batch
    episodes: Episodes | None = None  # multi-turn: turns, tool calls, the environment's rewards
    episode_of: Tensor | None = None  # (B + E,) agents' later sequences, rows B..: the episode of each row
    groups_dropped: int = 0  # groups an agent's failures left without a baseline (< 2 survivors): out of the loss
    log_gap: Tensor | None = None  # (B + E,) while the first on-policy minibatch runs: each of its rows' mean
    #   |log π_train - log π_sampler| (NaN elsewhere), for gspo.train.integrity.check_ratio

    def rows(self, idx: Tensor, ps: slice, ts: slice) -> Rows:
        """The per-row tensors of rows `idx`, cut to prompt columns `ps` and completion columns
        `ts` (a trimmed micro-batch's)."""
        P = self.rollout.prompt_ids.shape[1]

        def cut(x: Tensor | None) -> Tensor | None:  # (B, T, ...) or (B,) -> rows idx, columns ts
            return None if x is None else (x[idx][:, ts] if x.dim() >= 2 else x[idx])

        routing = None
        if self.routing is not None:  # (B, P+T, L, k): prompt and completion columns cut alike
            r = self.routing[idx]
            routing = torch.cat([r[:, :P][:, ps], r[:, P:][:, ts]], 1)
        return Rows(old_logp=cut(self.old_logp), advantages=cut(self.advantages), ref_logp=cut(self.ref_logp),
                    old_values=cut(self.old_values), returns=cut(self.returns), routing=routing,
                    is_weights=cut(self.is_weights), rollout_logp=cut(self.rollout.logp))


def prepare(run: Trains, ro: Rollout, scored: Scored) -> Batch:
    """The old policy's log-probs (the sampling pass's, paper §5.4, or recomputed), the
    reference's, and the advantages (`advantages`: group-relative over the global batch, per
    turn with --turn-advantages; or PPO's GAE over the model's tokens of an episode). run: a
    gspo.train.run.Run; scored: the rewards and rows. An episode's later sequences (`Episodes.more`:
    an agent's forked or edited histories) become rows after the B episodes', each with its episode's
    advantage (`episode_of`); rewards, examples and completions stay per episode. The no-grad passes run in
    micro-batches of the token budget, under mixed precision when on, with FSDP's parameters
    gathered (each process runs its own number of passes)."""
    cfg, dist = run.cfg, run.dist
    ro, episode_of = scored.episodes.with_more(ro) if scored.episodes is not None else (ro, None)  # (B + E) rows
    relative = not ESTIMATORS[estimator_name(cfg)].needs_values  # a group baseline (GAE's is the critic)
    gone = without_baseline(scored.episodes, cfg.sampling.group_size) if relative else None  # (B,) or None
    if gone is not None:
        rows = gone if episode_of is None else gone[episode_of.cpu()]  # (B + E,) a dropped group's rows
        ro.completion_mask = ro.completion_mask * (~rows).to(ro.completion_mask)[:, None]
    if cfg.loss.mask_truncated_completions:  # cut by max_new_tokens: out of the loss, still in the group's statistics
        ro.completion_mask = ro.completion_mask * (~ro.truncated)[:, None]
    split = Split(cfg.policy.micro_batch_tokens, max(1, ro.prompt_ids.shape[0] // cfg.loss.num_minibatches), run.packed)
    batch = Batch(rollout=ro, rewards=scored.rewards, all_rewards=dist.gather(scored.rewards),
                  reward_parts=scored.parts, advantages=None, old_logp=None, ref_logp=None,
                  examples=scored.examples, completions=scored.completions, episodes=scored.episodes,
                  episode_of=episode_of,
                  groups_dropped=baseless_groups(scored.episodes, cfg.sampling.group_size) if relative else 0)
    batch.old_logp, batch.routing = _old_logprobs(run, batch, split)  # (B, T), (B, P+T, L, k)
    batch.ref_logp = _ref_logprobs(run, ro, split)  # (B, T)
    batch.advantages, batch.old_values, batch.returns = advantages(run, batch, split)
    if run.teachers is not None:  # on-policy distillation: the teacher's per-token term (gspo.train.distill)
        distill(run, batch, split)
    if cfg.corrections.rollout_is != "off":  # π_old/π_rollout per token or response: fixed for the step's updates
        batch.is_weights, metrics = rollout_is_weights(batch.old_logp, ro.logp, ro.completion_mask,
                                                       cfg.corrections)
        batch.is_metrics = spread(reduce_across([metrics], dist)[0])  # over the global batch
    return batch


def advantages(run: Trains, batch: Batch, split: Split) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The step's advantages by the run's estimator (gspo.train.critic.estimator_name), this
    process's rows: group-relative ones over the global batch, (B,) or with --turn-advantages
    (B, T), each model turn's tokens its turn's; GAE's (B, T) over the critic's values. An agent's
    later sequences (`batch.episode_of`) get their episode's: its group-relative advantage, its
    call's with --turn-advantages, or GAE's with its episode's reward. Returns (advantages, the
    critic's old values, returns), the last two None without a critic."""
    cfg, dist, ro = run.cfg, run.dist, batch.rollout
    of = batch.episode_of if batch.episode_of is not None else slice(None)  # each row's episode
    estimator = ESTIMATORS[estimator_name(cfg)]
    if estimator.needs_values:
        old_values = run.critic.old_values(run, ro, split)  # (B, T)
        kl = batch.old_logp - batch.ref_logp if cfg.ppo.reward_kl_coef > 0 else None  # (B, T)
        adv, returns = estimator.fn(AdvantageInputs(
            batch.rewards[of], values=old_values, mask=ro.completion_mask, kl=kl, kl_coef=cfg.ppo.reward_kl_coef,
            gamma=cfg.ppo.gamma, lam=cfg.ppo.gae_lambda, whiten=cfg.ppo.whiten_advantages, all_sum=dist.all_sum))
        return adv, old_values, returns
    B, episodes = batch.rewards.shape[0], batch.episodes
    mine = slice(dist.rank * B, (dist.rank + 1) * B)  # this process's rows
    valid = survivors(episodes, dist)  # (B_all,) an agent's failed episodes out of their group's baseline; None: all
    if episodes is None or not cfg.episodes.turn_advantages:
        adv, _ = estimator.fn(AdvantageInputs(batch.all_rewards, group_size=cfg.sampling.group_size, valid=valid))
        return adv[mine][of].to(ro.logp.device), None, None  # (B,) or (B + E,)
    final = (batch.rewards - episodes.env_reward).to(torch.float64)  # (B,) the task's rewards, at the episode's end
    to_go = final[:, None] + episodes.rewards_to_go(run.max_turns)  # (B, K) R_{i,k}
    per_turn, _ = estimator.fn(AdvantageInputs(batch.all_rewards, group_size=cfg.sampling.group_size,
                                               to_go=dist.gather(to_go), valid=valid))
    index = episodes.turn_index.cpu()  # (B, T)
    if batch.episode_of is not None:  # the later sequences': their calls' indices in their episodes
        index = torch.cat([index, episodes.more_turn_index.cpu()])  # (B + E, T)
    return (per_turn[mine][of].gather(1, index.clamp(min=0)) * (index >= 0)).float().to(ro.logp.device), None, None


def distill(run: Trains, batch: Batch, split: Split) -> None:
    """Add the teachers' term to the batch's advantages: λ·(log π_T − log π_old) per token for a loss
    that takes per-token advantages, its mean over the response's tokens for a sequence-level one
    (GSPO, GMPO); rows no teacher serves get none. Sets batch.teacher_logp and batch.distill_metrics."""
    cfg, ro, G = run.cfg, batch.rollout, run.cfg.sampling.group_size
    of = batch.episode_of.tolist() if batch.episode_of is not None else range(ro.prompt_ids.shape[0])
    examples = [batch.examples[int(e) // G] for e in of]  # (B + E,) each row's example
    t0 = time.perf_counter()
    teacher_logp, served = run.teachers.logprobs(run, ro, examples, split)  # (B, T), (B,)
    seconds = time.perf_counter() - t0
    mask = ro.completion_mask * served.to(ro.completion_mask)[:, None]  # (B, T) the tokens a teacher scored
    per_token = LOSSES[cfg.loss.algorithm].turn_advantages
    term = distill_advantages(teacher_logp, batch.old_logp, mask, cfg.distill.distill_coef, per_token=per_token)
    batch.teacher_logp = teacher_logp
    metrics = {**distill_metrics(teacher_logp, batch.old_logp, term, mask), "time/teacher_seconds": Max(seconds)}
    batch.distill_metrics = reduce_across([metrics], run.dist)[0]
    batch.advantages = with_distill(batch.advantages, term.to(batch.advantages.device))


def survivors(episodes: Episodes | None, dist) -> Tensor | None:
    """(B_all,) bool: the global batch's episodes that did not fail (an agent's); None when none failed
    anywhere (every process asks: the gather is collective)."""
    if episodes is None or episodes.failed is None:
        return None
    ok = dist.gather(~episodes.failed.cpu())  # (B_all,)
    return None if bool(ok.all()) else ok


def without_baseline(episodes: Episodes | None, group_size: int) -> Tensor | None:
    """(B,) bool: the surviving episodes of groups that failures left with fewer than 2 survivors
    (no baseline: out of the loss); None when no episode failed."""
    if episodes is None or episodes.failed is None or not bool(episodes.failed.any()):
        return None
    failed = episodes.failed.cpu().view(-1, group_size)  # (B/G, G)
    thin = (failed.any(1) & ((~failed).sum(1) < 2))[:, None]  # (B/G, 1)
    return (thin & ~failed).flatten()  # (B,)


def baseless_groups(episodes: Episodes | None, group_size: int) -> int:
    """How many groups failures left with fewer than 2 survivors (none at all included)."""
    if episodes is None or episodes.failed is None:
        return 0
    failed = episodes.failed.cpu().view(-1, group_size)  # (B/G, G)
    return int((failed.any(1) & ((~failed).sum(1) < 2)).sum())


def _old_logprobs(run: Trains, batch: Batch, split: Split) -> tuple[Tensor, Tensor | None]:
    """log π_old (B, T) and the experts it used (MoE; else None): recorded while sampling, or
    recomputed. Multi-turn episodes record no experts while sampling: Routing Replay takes the
    recomputation's."""
    cfg, ro = run.cfg, batch.rollout
    if cfg.loss.old_logp == "sampling" and not (batch.episodes is not None and cfg.moe.routing_replay):
        return ro.logp, ro.routing  # (B, T) recorded while sampling
    with run.autocast(), parallel.gathered(run.train_model, run.dist):
        return token_logprobs(run.policy, ro, temperature=cfg.sampling.temperature, split=split, routing=run.routing)


def _ref_logprobs(run: Trains, ro: Rollout, split: Split) -> Tensor | None:
    """log π_ref (B, T) when beta > 0 or reward_kl_coef > 0: a frozen copy, or (LoRA) the base
    model with the adapters switched off; under FSDP its parameters gathered (LoRA: through the
    policy's root, which holds the embeddings)."""
    cfg = run.cfg
    if not (cfg.loss.beta > 0 or cfg.ppo.reward_kl_coef > 0):
        return None
    model, root = (run.reference, run.reference) if run.reference is not None else (run.policy, run.train_model)
    off = run.policy.disable_adapter() if run.reference is None else torch.no_grad()  # no_grad: nothing to switch
    with run.autocast(), parallel.gathered(root, run.dist), off:
        return token_logprobs(model, ro, temperature=cfg.sampling.temperature, split=split)[0]  # (B, T)


@torch.no_grad()
def expert_load(run: Trains, batch: Batch, parts: list[Tensor]) -> tuple[Tensor, float]:
    """Global-batch load balancing (arXiv 2501.11873): the routing slots each expert gets over
    the global minibatch, (L, E), and its real tokens, from a no-grad pass over its micro-batches
    (the same forwards, routing replay included), so that each micro-batch's part of the balance
    loss uses the minibatch's f_e and the split is exact (gspo.models.moe.balance_loss)."""
    cfg, routing = run.cfg, run.routing
    counts = torch.zeros(routing.n_layers, routing.num_experts, dtype=torch.float64)  # (L, E)
    tokens = 0.0
    # stand-ins too: FSDP's forwards are collective
    for m in passes(batch.rollout, parts, cfg.policy.micro_batch_tokens):
        forced = batch.rows(m.idx, m.ps, m.ts).routing if cfg.moe.routing_replay else None
        with routing.capture(forced, keep_logits=True) as cap, run.autocast():
            run.train_model(m.rollout, temperature=cfg.sampling.temperature, packed=False)
        tokens_mask = m.rollout.attention_mask * m.live  # (b, P+T)
        counts += expert_counts([torch.cat(x) for x in cap.logits], tokens_mask, routing.top_k).cpu().double()
        tokens += float(tokens_mask.sum())
    both = run.dist.all_sum(torch.cat([counts.flatten(), counts.new_tensor([tokens])]))
    return both[:-1].view_as(counts), float(both[-1])
