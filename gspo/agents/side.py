"""The sampling side of a run, agents included, built from its configuration.

    task = task_for(cfg, inputs)                               # verifiers:ID tasks too
    env, max_turns, play = episodes_for(cfg.episodes.env, task, cfg.episodes.max_turns, tokenizer)
    side = sampling_side(cfg, device)                          # a rollout worker's own copy

gspo.sampling.samplers builds the task, the policy, the rewards and the sampler from names; this
room adds what only it knows: a `verifiers:ID` task (gspo.agents.vfenv), a TRL environment class
made a gspo environment (gspo.agents.trlenv), and who plays the episodes of an environment (gspo's
multi-turn loop, gspo.sampling.episodes) or of an agent (the endpoint, gspo.agents.runner).
"""

from __future__ import annotations

import dataclasses

import torch

from gspo.agents.runner import run_agent_episodes
from gspo.agents.trlenv import adapted
from gspo.agents.vfenv import VerifiersTask, is_verifiers
from gspo.config import TrainConfig
from gspo.models.loading import DTYPES, cast_parameters, disable_dropout
from gspo.processes.distributed import Dist
from gspo.rewards.builtin import Reward
from gspo.sampling import samplers
from gspo.sampling.episodes import run_episodes
from gspo.sampling.produce import SamplingSide
from gspo.sampling.rollout import stop_token_ids
from gspo.sampling.samplers import Inputs, load_policy_for, rewards_for, sampler_and_routing
from gspo.tasks.base import for_tokenizer
from gspo.tasks.env import episode_env, is_agent
from gspo.tasks.gym import parse_options


def task_for(cfg: TrainConfig, inputs: Inputs | None = None):
    """The run's task (gspo.sampling.samplers.task_for), a `--task verifiers:ID` one included."""
    inputs = inputs or Inputs()
    if (inputs.task is None and cfg.data.dataset is None and inputs.train_dataset is None
            and is_verifiers(cfg.data.task)):
        options = parse_options(cfg.data.task_options)
        task = VerifiersTask.from_spec(cfg.data.task, options, test_size=cfg.eval.eval_size)
        inputs = dataclasses.replace(inputs, task=task)
    return samplers.task_for(cfg, inputs)


def task_and_rewards(cfg: TrainConfig, inputs: Inputs | None = None) -> tuple[object, list[Reward]]:
    """The task (built-in, verifiers', the user's dataset file, or in-memory rows; validated) and its rewards."""
    task = task_for(cfg, inputs)
    return task, rewards_for(cfg, task, inputs or Inputs())


def episodes_for(spec, task, max_turns: int | None, tokenizer) -> tuple[type | None, int, object]:
    """The run's environment (or agent), its turn limit, and who plays its episodes: `spec` is --env
    (a name, a class, an agent; a TRL environment class is adapted), else the task's own
    (gspo.tasks.env.episode_env). (None, 1, run_episodes) for single-turn completions."""
    env, turns = episode_env(adapted(spec), task, max_turns, tokenizer)
    return env, turns, run_agent_episodes if env is not None and is_agent(env) else run_episodes


def sampling_side(cfg: TrainConfig, device: torch.device) -> SamplingSide:
    """A rollout worker's copy of the run's sampling side, from the trainer's resolved configuration
    (gspo.sampling.pipeline's `build`). gspo's sampler without LoRA: the worker's policy is held in
    the sampling dtype and samples itself (the trainer's process keeps float32 master weights and a
    copy in that dtype: the same values, rounded alike, at half the memory). Loaded in that dtype,
    then every parameter cast to it as the trainer's copy casts it (gspo.models.loading.cast_parameters:
    a loader keeps some models' modules in float32). With LoRA (PEFT keeps the adapters of a bf16
    base in float32, unlike the copy) and for a vLLM engine the policy is in --param-dtype."""
    inputs = Inputs()
    task = task_for(cfg, inputs)
    own = cfg
    if cfg.sampling.rollout_engine == "hf" and cfg.lora.lora_r == 0:
        dtype = cfg.policy.dtype if cfg.sampling.rollout_dtype == "same" else cfg.sampling.rollout_dtype
        own = dataclasses.replace(cfg, param_dtype=dtype, dtype=dtype, rollout_dtype="same")
    policy, tokenizer = load_policy_for(own, None, device, inputs)
    task = for_tokenizer(task, tokenizer)  # as the trainer's process frames its prompts
    if own.policy.param_dtype != cfg.policy.param_dtype:  # where the trainer's process makes its low-precision copy
        cast_parameters(policy, DTYPES[own.policy.param_dtype])
    disable_dropout(policy)
    env, max_turns, play = episodes_for(cfg.episodes.env, task, cfg.episodes.max_turns, tokenizer)
    sampler, _ = sampler_and_routing(own, policy, Dist(device=device), inputs)
    rewards = rewards_for(cfg, task, inputs, device)
    return SamplingSide(cfg=cfg, dist=Dist(device=device), task=task, tokenizer=tokenizer, policy=policy,
                        rewards=rewards, sampler=sampler, env=env, max_turns=max_turns,
                        stop_ids=stop_token_ids(tokenizer, policy, cfg.sampling.stop_token), play=play)
