"""A scored rollout batch: everything the updates of one step read, per row, and how it is made.

    batch = prepare(run, rollout, rewards=r, parts=p, examples=ex, completions=texts)   # a Batch
    cols = batch.rows(idx, ps, ts)   # the per-row tensors of rows idx, cut to a trimmed micro-batch's columns

`prepare` adds to a scored rollout the old policy's log-probs, the reference's and the
advantages; the batch is read by gspo.trainer's `minibatch_loss`, the metrics of the step and
samples.jsonl. `expert_load` counts, for an MoE balance loss split over micro-batches, the
experts' load over the whole minibatch (a no-grad pass before the minibatch's updates).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gspo import parallel
from gspo.advantages import group_advantages, turn_advantages
from gspo.corrections import rollout_is_weights
from gspo.episodes import Episodes
from gspo.logprobs import token_logprobs, trim
from gspo.metrics import reduce_across
from gspo.moe import expert_counts
from gspo.rollout import Rollout
from gspo.value import ppo_advantages

Tensor = torch.Tensor


@dataclass
class Batch:
    """A scored rollout batch, ready for updates: this process's rows (B of B_all)."""

    rollout: Rollout
    rewards: Tensor  # (B,) weighted sum of all rewards
    all_rewards: Tensor  # (B_all,) every process's rewards, in rank order
    reward_parts: dict[str, list[float]]  # name -> (B,) each reward's values
    advantages: Tensor  # (B,) group-relative, or (B, T) from GAE (PPO)
    old_logp: Tensor  # (B, T) log π_θold of the sampled tokens
    ref_logp: Tensor | None  # (B, T) log π_ref, when beta > 0 or reward_kl_coef > 0
    examples: list  # (B / G,) the prompts' Examples
    completions: list[str]  # (B,) decoded completions
    old_values: Tensor | None = None  # (B, T) PPO: V_old(s_t) before the updates
    returns: Tensor | None = None  # (B, T) PPO: GAE returns, the value targets
    routing: Tensor | None = None  # (B, P+T, L, k) MoE: experts used under the old policy
    is_weights: Tensor | None = None  # (B, T) --rollout-is: π_old/π_rollout, truncated or masked
    is_metrics: dict | None = None  # their statistics over the global batch (gspo.corrections)
    episodes: Episodes | None = None  # multi-turn: turns, tool calls, the environment's rewards

    def rows(self, idx: Tensor, ps: slice, ts: slice) -> dict[str, Tensor | None]:
        """The per-row tensors of rows `idx`, cut to prompt columns `ps` and completion columns
        `ts` (a trimmed micro-batch's)."""
        P = self.rollout.prompt_ids.shape[1]

        def cut(x: Tensor | None) -> Tensor | None:  # (B, T, ...) or (B,) -> rows idx, columns ts
            return None if x is None else (x[idx][:, ts] if x.dim() >= 2 else x[idx])

        routing = None
        if self.routing is not None:  # (B, P+T, L, k): prompt and completion columns cut alike
            r = self.routing[idx]
            routing = torch.cat([r[:, :P][:, ps], r[:, P:][:, ts]], 1)
        return {"old_logp": cut(self.old_logp), "advantages": cut(self.advantages), "ref_logp": cut(self.ref_logp),
                "old_values": cut(self.old_values), "returns": cut(self.returns), "routing": routing,
                "is_weights": cut(self.is_weights), "rollout_logp": cut(self.rollout.logp)}


def prepare(run, ro: Rollout, *, rewards: Tensor, parts: dict, examples: list, completions: list[str],
            episodes: Episodes | None = None) -> Batch:
    """The old policy's log-probs (the sampling pass's, paper §5.4, or recomputed), the
    reference's, and the advantages: group-relative over the global batch (per turn with
    --turn-advantages), or GAE (PPO, over the model's tokens of an episode). run: a gspo.run.Run.
    The no-grad passes run in micro-batches of the token budget, under mixed precision when
    on, with FSDP's parameters gathered (each process runs its own number of passes)."""
    cfg, dist, vm = run.cfg, run.dist, run.value_model
    all_rewards = dist.gather(rewards)  # (B_all,)
    if cfg.mask_truncated_completions:  # cut by max_new_tokens: out of the loss, still in the group's statistics
        ro.completion_mask = ro.completion_mask * (~ro.truncated)[:, None]
    passes = dict(temperature=cfg.temperature, budget=cfg.micro_batch_tokens, packed=run.packed,
                  rows=max(1, ro.prompt_ids.shape[0] // cfg.num_minibatches))
    # multi-turn episodes record no experts while sampling: Routing Replay takes the recomputation's
    if cfg.old_logp == "sampling" and not (episodes is not None and cfg.routing_replay):
        old_logp, old_routing = ro.logp, ro.routing  # (B, T) recorded while sampling
    else:
        with run.autocast(), parallel.gathered(run.train_model, dist):
            old_logp, old_routing = token_logprobs(run.policy, ro, routing=run.routing, **passes)  # (B, T)
    ref_logp = None
    if cfg.beta > 0 or cfg.reward_kl_coef > 0:
        # a frozen copy, or (LoRA) the base model with the adapters switched off; under FSDP its
        # parameters gathered (LoRA: through the policy's root, which holds the embeddings)
        model, root = (run.reference, run.reference) if run.reference is not None else (run.policy, run.train_model)
        off = run.policy.disable_adapter() if run.reference is None else torch.no_grad()  # no_grad: nothing to switch
        with run.autocast(), parallel.gathered(root, dist), off:
            ref_logp, _ = token_logprobs(model, ro, **passes)  # (B, T)
    old_values = returns = None
    if vm is not None:  # PPO: GAE over the critic's values
        with run.autocast(), parallel.gathered(vm.critic_train or run.train_model, dist):
            old_values = vm.values(run.policy, ro, **passes)  # (B, T)
        kl = old_logp - ref_logp if cfg.reward_kl_coef > 0 else None  # (B, T)
        # GAE runs over the model's tokens alone: an episode's are moved to the front, in order
        order = torch.sort((ro.completion_mask == 0).to(torch.uint8), dim=1, stable=True).indices  # (B, T)
        front = lambda x: None if x is None else x.gather(1, order)  # noqa: E731
        advantages, returns = ppo_advantages(rewards, front(old_values), front(ro.completion_mask), gamma=cfg.gamma,
                                             lam=cfg.gae_lambda, kl=front(kl), kl_coef=cfg.reward_kl_coef,
                                             whiten=cfg.whiten_advantages, all_sum=dist.all_sum)
        advantages, returns = (torch.zeros_like(x).scatter(1, order, x) for x in (advantages, returns))  # back
    else:
        advantages = _group_advantages(run, rewards, all_rewards, episodes).to(ro.logp.device)
    batch = Batch(ro, rewards, all_rewards, parts, advantages, old_logp, ref_logp, examples, completions,
                  old_values, returns, old_routing, episodes=episodes)
    if cfg.rollout_is != "off":  # π_old/π_rollout per token or response: fixed for the step's updates
        batch.is_weights, metrics = rollout_is_weights(old_logp, ro.logp, ro.completion_mask, level=cfg.rollout_is,
                                                       mode=cfg.rollout_is_mode, low=cfg.rollout_is_low,
                                                       high=cfg.rollout_is_high)
        batch.is_metrics = reduce_across([metrics], dist)[0]  # over the global batch
    return batch



def _group_advantages(run, rewards: Tensor, all_rewards: Tensor, episodes: Episodes | None) -> Tensor:
    """This process's rows of the group-relative advantages over the global batch: (B,) one
    per response, or with --turn-advantages (B, T), each model turn's tokens its turn's."""
    cfg, dist, B = run.cfg, run.dist, rewards.shape[0]
    mine = slice(dist.rank * B, (dist.rank + 1) * B)  # this process's rows
    if episodes is None or not cfg.turn_advantages:
        return group_advantages(all_rewards, cfg.group_size, scale=cfg.adv_scale)[mine]  # (B,)
    final = (rewards - episodes.env_reward).to(torch.float64)  # (B,) the task's rewards, at the episode's end
    to_go = final[:, None] + episodes.rewards_to_go(run.max_turns)  # (B, K) R_{i,k}
    per_turn = turn_advantages(dist.gather(to_go), cfg.group_size, scale=cfg.adv_scale)[mine]  # (B, K)
    index = episodes.turn_index.cpu()  # (B, T)
    return (per_turn.gather(1, index.clamp(min=0)) * (index >= 0)).float()  # (B, T)


@torch.no_grad()
def expert_load(run, batch: Batch, parts: list[Tensor]) -> tuple[Tensor, float]:
    """Global-batch load balancing (arXiv 2501.11873): the routing slots each expert gets over
    the global minibatch, (L, E), and its real tokens, from a no-grad pass over its micro-batches
    (the same forwards, routing replay included), so that each micro-batch's part of the balance
    loss uses the minibatch's f_e and the split is exact (gspo.moe.balance_loss)."""
    cfg, routing = run.cfg, run.routing
    counts = torch.zeros(routing.n_layers, routing.num_experts, dtype=torch.float64)  # (L, E)
    tokens = 0.0
    for part in parts:
        live = 1.0 if len(part) else 0.0
        part = part if len(part) else torch.zeros(1, dtype=torch.long)  # a stand-in: FSDP's forwards are collective
        mb, ps, ts = trim(batch.rollout.select(part)) if cfg.micro_batch_tokens > 0 else \
            (batch.rollout.select(part), slice(None), slice(None))
        forced = batch.rows(part, ps, ts)["routing"] if cfg.routing_replay else None
        with routing.capture(forced, keep_logits=True) as cap, run.autocast():
            run.train_model(mb, temperature=cfg.temperature, packed=False)
        tokens_mask = mb.attention_mask * live  # (b, P+T)
        counts += expert_counts([torch.cat(x) for x in cap.logits], tokens_mask, routing.top_k).cpu().double()
        tokens += float(tokens_mask.sum())
    both = run.dist.all_sum(torch.cat([counts.flatten(), counts.new_tensor([tokens])]))
    return both[:-1].view_as(counts), float(both[-1])
