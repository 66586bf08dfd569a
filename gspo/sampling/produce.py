"""Producing a step's batch: its prompts, sampled and scored, tagged with the policy version that sampled it.

    produced = produce(side, step=5, version=4)   # a Produced: rollout, scored rows, versions
    ro, texts, ids, episodes = rollout(run, examples, step)

`side` is a SamplingSide: the run's (gspo.train.run.Run is one), or a rollout worker's own, built
from the configuration (gspo.agents.side.sampling_side). What a batch holds is a function of (seed,
step) and the weights that sample it: the prompts are the task's `train_batch(step)`, the sampling
uniforms come from
`step_generator(seed, step, ...)`; so the same batch is produced in the trainer's process or in
a rollout worker, now or K versions earlier (gspo.sampling.pipeline).

--drop-uniform-groups (DAPO's dynamic sampling): a group whose rewards are all equal has no
advantage signal; it is replaced by a group with signal from up to --resample-rounds further
rounds of fresh prompts, and what is still uniform after them is left out of the loss.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gspo.config import ConfigError
from gspo.models.sequences import Rollout
from gspo.rewards.builtin import Reward, TrainerState, score_completions
from gspo.sampling.episodes import Draws, Episodes, EpisodeSpec, run_episodes
from gspo.sampling.integrity import Receipts, Recorded
from gspo.sampling.rollout import cut_at_stop_strings, decode_completions, encode_prompts, sampling_params
from gspo.tasks.scoring import Scored

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo.config import TrainConfig
    from gspo.processes.distributed import Dist
    from gspo.sampling.rollout import Sampler
    from gspo.tasks.base import Task

Tensor = torch.Tensor


@dataclass(kw_only=True)
class SamplingSide:
    """What sampling and scoring a batch read. A gspo.train.run.Run is one (the trainer's process
    samples); a rollout worker builds its own from the configuration (gspo.agents.side)."""

    cfg: TrainConfig
    dist: Dist
    task: Task
    tokenizer: PreTrainedTokenizerBase
    policy: torch.nn.Module
    rewards: list[Reward]
    sampler: Sampler | None = None  # who samples rollouts
    env: type | None = None  # multi-turn: the environment class or agent (gspo.tasks.env), one per episode
    max_turns: int = 1  # model turns per episode at most
    stop_ids: tuple[int, ...] = ()  # tokens that end a completion (gspo.sampling.rollout.stop_token_ids)
    # plays a step's episodes of `env`: (sampler, tokenizer, examples, spec, params, draws) -> (Rollout,
    # Episodes). An environment's by default (gspo.sampling.episodes); an agent's: gspo.agents.runner
    play: Callable = run_episodes


@dataclass
class Produced:
    """A sampled and scored batch (this process's rows), ready for `prepare`."""

    step: int  # the training step that consumes it
    version: int  # the policy version that sampled it: the steps done when its weights were current
    rollout: Rollout
    scored: Scored
    versions: Tensor  # (B, T) int32: the version that sampled each completion token (-1 on padding)
    groups: dict  # groups/dropped, groups/resampled, groups/rounds (--drop-uniform-groups)
    seconds: float  # sampling and scoring time
    worker: int = -1  # the rollout worker that made it; -1: the trainer's process
    idle: float = 0.0  # the worker's wait for this request
    receipts: Receipts | None = None  # what its samplers drew (gspo.sampling.integrity; None: a batch from before)

    def on(self, device) -> Produced:
        """The same batch with its rollout's tensors on `device`."""
        return dataclasses.replace(self, rollout=self.rollout.map(lambda t: t.to(device)))


def step_generator(seed: int, step: int, purpose: str) -> torch.Generator:
    """A CPU generator that is a function of (seed, step, purpose) alone: a resumed run, or a
    run split across processes, draws the same numbers for the same step."""
    digest = hashlib.sha256(f"gspo-{seed}-{step}-{purpose}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def produce(side: SamplingSide, step: int, version: int) -> Produced:
    """Batch `step`, sampled with the weights `side` holds now (policy version `version`), scored."""
    cfg = side.cfg
    t0 = time.perf_counter()
    receipts = Receipts()  # every sample of every round: what the integrity check reads (gspo.sampling.integrity)
    ro, scored = _round(side, step, 0, receipts, version)
    groups = {"groups/dropped": 0.0, "groups/resampled": 0.0, "groups/rounds": 1.0}
    if cfg.async_rl.drop_uniform_groups:
        ro, scored, groups = _drop_uniform(side, step, (ro, scored), receipts, version)
    live = ro.completion_mask.cpu() > 0
    if ro.versions is not None:  # partial rollouts: each token's own (a generation that spanned a weight sync)
        versions = torch.where(live, ro.versions.cpu(), -1).to(torch.int32)
        if bool((versions[live] < version).any()):  # a token older than the batch's request: a bug, never the user's
            raise RuntimeError(f"batch {step}: a token sampled by version {int(versions[live].min())}, older than "
                               f"the version {version} that asked for it")
    else:
        versions = torch.where(live, version, -1).to(torch.int32)
    return Produced(step, version, ro, scored, versions, groups, time.perf_counter() - t0, receipts=receipts)


def _round(side: SamplingSide, step: int, r: int, receipts: Receipts | None = None,
           version: int | None = None) -> tuple[Rollout, Scored]:
    """Sampling round `r` of batch `step`: round 0 is the step's prompts; later rounds (refills
    for uniform groups) draw fresh ones, and fresh uniforms."""
    cfg, dist = side.cfg, side.dist
    n = cfg.sampling.prompts_per_step // dist.world
    seed = cfg.run.seed if r == 0 else cfg.run.seed + 1_000_003 * r
    examples = side.task.train_batch(step, cfg.sampling.prompts_per_step, seed)[dist.rank * n:(dist.rank + 1) * n]
    ro, completions, completion_ids, episodes = rollout(side, examples, step, "" if r == 0 else f"-round-{r}",
                                                        receipts, version)
    state = TrainerState(step - 1, cfg.run.steps)
    if episodes is not None:  # a failed episode (an agent's) is never scored
        rewards, parts = score_episodes(side.rewards, examples, episodes, cfg.sampling.group_size, state)
    else:
        rewards, parts = score_completions(side.rewards, examples, completions, completion_ids,
                                           cfg.sampling.group_size, state)
    rewards, parts = with_env_rewards(rewards, parts, episodes)  # (B,)
    if episodes is not None:  # the environments have scored (`environments=`) and stay here: the batch goes to
        # the trainer's process and into checkpoints, where an instance of a file's class (--env file.py:Class)
        # or of one holding a socket cannot be pickled
        episodes = dataclasses.replace(episodes, envs=None)
    return ro, Scored(rewards, parts, examples, completions, episodes)


def rollout(run: SamplingSide, examples: list, step: int, purpose: str = "", receipts: Receipts | None = None,
            version: int | None = None) -> tuple[Rollout, list[str], list[list[int]], Episodes | None]:
    """Sample cfg.sampling.group_size completions per example with the run's sampler, from the current
    policy's weights; returns the rollout, the texts and token ids the rewards score, and (with
    an environment) the episodes (gspo.sampling.episodes: the texts are then each episode's final model
    turn). Several processes: these are rows (offset, total) of the global batch (see
    gspo.sampling.rollout.generate). purpose: a refill round's suffix of the generators' purpose.
    receipts: where every sample leaves what it drew (gspo.sampling.integrity; None: nowhere).
    version: the policy version the weights are (`Sampler.sync`'s; None: unknown)."""
    cfg, dist, G = run.cfg, run.dist, run.cfg.sampling.group_size
    params = sampling_params(run.tokenizer, stop=run.stop_ids, group_size=G, max_new_tokens=cfg.sampling.max_new_tokens,
                             temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                             min_new_tokens=cfg.sampling.min_new_tokens, cuda_graphs=cfg.sampling.cuda_graphs)
    run.sampler.sync(run.policy, version=version)
    sampler = Recorded(run.sampler, receipts) if receipts is not None else run.sampler
    rows = (dist.rank * len(examples) * G, cfg.sampling.prompts_per_step * G)
    if run.env is not None:
        spec = EpisodeSpec.from_config(cfg, run.env, run.max_turns)
        draws = Draws(lambda turn: step_generator(cfg.run.seed, step, (f"sample-turn-{turn}" if turn else "sample")
                                                  + purpose), rows, dist)
        try:
            ro, ep = run.play(sampler, run.tokenizer, examples, spec, params, draws)  # an environment's or an agent's
        finally:  # an environment that raised mid-rollout leaves no kept KV cache (gspo.sampling.turncache) behind
            run.sampler.end_rollout()  # vLLM: sleeps after the last turn's sample
        return ro, ep.final_texts, ep.final_ids, ep
    prompts = encode_prompts(run.tokenizer, [ex.prompt for ex in examples], cfg.data.max_prompt_length)
    ro = sampler.sample(prompts, params, generator=step_generator(cfg.run.seed, step, "sample" + purpose), rows=rows)
    run.sampler.end_rollout()  # vLLM: sleeps after the last sample
    ro = cut_at_stop_strings(ro, run.tokenizer, cfg.sampling.stop_string)
    texts, ids = decode_completions(run.tokenizer, ro)
    return ro, texts, ids, None


def score(rewards: list[Reward], examples, completions: list[str], completion_ids, group_size: int,
          episodes: Episodes | None = None):
    """Weighted reward of each completion (B,) and each reward's values; row b is example b // G.
    Episodes: plus the environment's rewards over the episode (its own part, `env`). (A training
    step's rewards also get the trainer's state, the steps done and the run's steps, as TRL's do.)"""
    if episodes is not None:
        total, parts = score_episodes(rewards, examples, episodes, group_size, TrainerState())
    else:
        total, parts = score_completions(rewards, examples, completions, completion_ids, group_size, TrainerState())
    return with_env_rewards(total, parts, episodes)


def score_episodes(rewards: list[Reward], examples: list, episodes: Episodes, group_size: int,
                   state: TrainerState) -> tuple[list[float], dict]:
    """The rewards of each episode's final model turn (`score_completions`, the episodes'
    environments as `environments=`), row b of example b // group_size. A failed episode (an
    agent's: it raised, ran out of time, or broke the contract) is never scored: its total is 0
    and each reward's value NaN (does not apply), and the rewards are called on the others alone."""
    B = len(episodes.final_texts)
    failed = episodes.failed.tolist() if episodes.failed is not None else [False] * B
    envs = episodes.envs
    if not any(failed):
        return score_completions(rewards, examples, episodes.final_texts, episodes.final_ids, group_size,
                                 dataclasses.replace(state, environments=envs))
    keep = [b for b in range(B) if not failed[b]]
    total, parts = [0.0] * B, {r.name: [float("nan")] * B for r in rewards}
    if keep:
        sub = dataclasses.replace(state, environments=[envs[b] for b in keep] if envs is not None else None)
        kept, kept_parts = score_completions(rewards, [examples[b // group_size] for b in keep],
                                             [episodes.final_texts[b] for b in keep],
                                             [episodes.final_ids[b] for b in keep], 1, sub)
        for j, b in enumerate(keep):
            total[b] = kept[j]
            for name, values in kept_parts.items():  # a reward's own metrics too (a judge's)
                parts.setdefault(name, [float("nan")] * B)[b] = values[j]
    return total, parts


def with_env_rewards(total: list[float], parts: dict, episodes: Episodes | None) -> tuple[Tensor, dict]:
    """The rewards' total as a tensor (B,), plus (episodes) the environment's over each episode."""
    total = torch.tensor(total, dtype=torch.float32)
    if episodes is not None:
        parts["env"] = episodes.env_reward.tolist()
        total = total + episodes.env_reward
    return total, parts


# ----------------------------------------------------------------------------------------------
# --drop-uniform-groups
# ----------------------------------------------------------------------------------------------


def uniform_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(N,) bool: groups whose G rewards are all equal (no advantage signal)."""
    g = rewards.view(-1, group_size)
    return g.amax(1) == g.amin(1)


def _drop_uniform(side: SamplingSide, step: int, first: tuple[Rollout, Scored],
                  receipts: Receipts, version: int | None = None) -> tuple[Rollout, Scored, dict]:
    """Replace uniform groups by groups with signal from further rounds; mask out what remains.
    Every process runs as many rounds (sampling may be collective: FSDP gathers). `first`: the
    first round's (rollout, scored)."""
    cfg, dist, G = side.cfg, side.dist, side.cfg.sampling.group_size
    ro, scored = first
    if scored.episodes is not None:  # gspo.train.resolve refuses it by name; a side built by hand gets here
        raise ConfigError("drop_uniform_groups: cannot be combined with multi-turn episodes yet (their refill "
                          f"rounds would need their episodes joined; env {getattr(side.env, '__name__', side.env)})")
    flat = uniform_groups(scored.rewards, G).tolist()  # (N,) the first round's groups without signal
    pool, spare = [(ro, scored)], []  # the rounds' (rollout, scored); (round, group) of the refills' groups with signal
    for r in range(1, cfg.async_rl.resample_rounds + 1):
        if dist.max_int(max(0, sum(flat) - len(spare))) == 0:
            break
        pool.append(_round(side, step, r, receipts, version))
        spare += [(r, g) for g, u in enumerate(uniform_groups(pool[-1][1].rewards, G).tolist()) if not u]
    replaced = min(sum(flat), len(spare))
    picks = [spare.pop(0) if u and spare else (0, g) for g, u in enumerate(flat)]
    ro, scored = _gather_groups(pool, picks, G)
    still = uniform_groups(scored.rewards, G).repeat_interleave(G)  # (B,)
    keep = (~still).to(ro.completion_mask.device, ro.completion_mask.dtype)  # (B,) 0 on groups still uniform
    ro.completion_mask = ro.completion_mask * keep[:, None]
    return ro, scored, {"groups/dropped": float(still.sum() // G), "groups/resampled": float(replaced),
                        "groups/rounds": float(len(pool))}


def _gather_groups(pool: list[tuple[Rollout, Scored]], picks: list[tuple[int, int]], G: int) -> tuple[Rollout, Scored]:
    """The groups `picks` ((round, group) each) of the rounds' rollouts, as one rollout (padded
    to the widest prompt and completion) and its scored rows."""
    P = max(ro.prompt_ids.shape[1] for ro, _ in pool)
    T = max(ro.completion_ids.shape[1] for ro, _ in pool)
    padded = [_pad(ro, P, T) for ro, _ in pool]
    rows = [(k, g * G + j) for k, g in picks for j in range(G)]
    fields = {}
    for f in dataclasses.fields(Rollout):
        first = getattr(padded[0], f.name)
        if isinstance(first, Tensor):
            fields[f.name] = torch.stack([getattr(padded[k], f.name)[i] for k, i in rows])
    ro = dataclasses.replace(padded[0], **fields)
    scored = [s for _, s in pool]
    parts = {name: [scored[k].parts[name][i] for k, i in rows] for name in scored[0].parts}
    return ro, Scored(torch.stack([scored[k].rewards[i] for k, i in rows]), parts,
                      [scored[k].examples[g] for k, g in picks], [scored[k].completions[i] for k, i in rows])


def _pad(ro: Rollout, P: int, T: int) -> Rollout:
    """`ro` with its prompts left-padded to P columns and its completions right-padded to T."""
    p, t = P - ro.prompt_ids.shape[1], T - ro.completion_ids.shape[1]
    if p == 0 and t == 0:
        return ro
    left = lambda x: torch.nn.functional.pad(x, (p, 0))  # noqa: E731
    right = lambda x: torch.nn.functional.pad(x, (0, t))  # noqa: E731
    out = dataclasses.replace(ro, prompt_ids=left(ro.prompt_ids), prompt_mask=left(ro.prompt_mask),
                              completion_ids=right(ro.completion_ids), completion_mask=right(ro.completion_mask),
                              logp=right(ro.logp))
    if ro.versions is not None:
        out.versions = torch.nn.functional.pad(ro.versions, (0, t), value=-1)
    if ro.routing is not None:  # (B, P+T, L, k): -1 where nothing was fed
        r = ro.routing
        pad = lambda n: r.new_full((r.shape[0], n, *r.shape[2:]), -1)  # noqa: E731
        out.routing = torch.cat([pad(p), r, pad(t)], 1)
    return out
