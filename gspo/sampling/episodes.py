"""Multi-turn episodes: the model and an environment take turns, token in, token out.

    from gspo.sampling.episodes import EpisodeSpec, run_episodes
    ro, ep = run_episodes(sampler, tokenizer, examples, EpisodeSpec(CalculatorEnv, max_turns=3), params)

`ro` is a gspo.sampling.rollout.Rollout whose completion is the whole episode after the prompt: the
model's turns (completion_mask 1, the log-probs recorded while sampling) and, between them,
the environment's tokens (env_mask 1: in the context, never in the loss, the ratios, the clip
fractions or any per-token metric; log-prob 0). So every loss, aggregation and correction of
the single-turn path applies unchanged: GSPO's s_i is the length-normalised ratio over the
episode's model tokens, GRPO's ratios are those of the model tokens. `ep` (`Episodes`) holds
what the rewards and metrics need: the final model turn's text (what the task's rewards
score), the environment's reward per turn, the turn of every column (per-turn advantages),
tool calls and errors.

How a turn goes. Every episode still running is sampled one turn (turn 0: the prompts, G
episodes each, exactly as a single-turn rollout; later turns: one completion per episode
from its conversation so far, prompt + every token since). The model's turn, decoded with
special tokens skipped, goes to its environment's `step`; the messages that come back are
rendered by the chat template (gspo.tasks.env.observation_text) and appended as tokens, and the
next turn starts after them. gspo's own sampler keeps each episode's KV cache between turns,
so a later turn feeds only its last sampled token and the environment's tokens
(gspo.sampling.turncache); an inference engine's prefix cache does the same.

An episode ends when the environment says done, after `max_turns` model turns, or when its
turn was cut by max_new_tokens or the episode's token budget (the spec's `max_tokens`, model
and environment tokens after the prompt): then it is flagged truncated. One ended by
`max_turns` (the environment not done) is not truncated, its last turn having ended, but is
flagged `turn_limit`.

Randomness (`Draws`): turn k of the step draws from its own generator (`generator_for(k)`) and
each episode from its global row index (`rows`), so a run split across processes samples exactly
what one process does. Every process samples the same number of turns (with `dist`, a process
whose episodes have all ended samples a stand-in row): under FSDP, sampling gathers parameters
collectively.

The environments' steps of a turn run one after another, or up to the class's `concurrency`
at once in threads (run_steps); asynchronous environments are left out.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from gspo.config import TrainConfig
from gspo.models.sequences import Rollout
from gspo.sampling.rollout import SamplingParams, cut_at_stop_strings, encode_prompts
from gspo.tasks.env import EnvError, Step, observation_text, tool_schemas

Tensor = torch.Tensor


@dataclass(frozen=True)
class EpisodeSpec:
    """What an episode is: its environment and its limits (evaluation's single-turn rows use the
    same prompt limit and stop strings, with `env` None).

    env: the environment class (gspo.tasks.env); None: single-turn. max_turns: model turns at most.
    max_tokens: the episode's token budget after the prompt, model and environment tokens
    together (0: none). stop_strings: a model turn is cut after the first. max_prompt_length:
    prompts keep their last this many tokens (0: no limit)."""

    env: type | None = None
    max_turns: int = 1
    max_tokens: int = 0
    stop_strings: tuple[str, ...] = ()
    max_prompt_length: int = 0
    timeout: float = 0.0  # agents (gspo.agents.runner): an episode's deadline in seconds (0: none)

    @classmethod
    def from_config(cls, cfg: TrainConfig, env, max_turns: int) -> EpisodeSpec:
        """A run's spec: `env` and `max_turns` as resolved (gspo.train.run.episode_env), the limits from
        the config's sections (episodes.max_episode_tokens, sampling.stop_string, data.max_prompt_length)."""
        return cls(env, max_turns, cfg.episodes.max_episode_tokens, cfg.sampling.stop_string,
                   cfg.data.max_prompt_length, cfg.episodes.episode_timeout)


@dataclass(frozen=True)
class Draws:
    """How this process draws its episodes (module docstring, Randomness): `generator_for(turn)`
    the generator of each turn; `rows` (offset, total): these are rows offset... of `total` across
    processes (None: all of them); `dist` (gspo.processes.distributed.Dist): every process samples every turn."""

    generator_for: Callable[[int], torch.Generator | None] = lambda turn: None
    rows: tuple[int, int] | None = None
    dist: object = None


@dataclass(frozen=True)
class _Turns:
    """What every turn of a run_episodes call reads."""

    spec: EpisodeSpec
    params: SamplingParams
    tokenizer: object
    tools: list


@dataclass
class Episodes:
    """Per episode (row): what the rewards, advantages and metrics need beyond the Rollout."""

    final_texts: list[str]  # (B,) the last model turn, special tokens skipped: what the task's rewards score
    final_ids: list[list[int]]  # (B,) its token ids
    transcripts: list[str]  # (B,) the episode after the prompt as the model saw it (special tokens kept)
    turn_index: Tensor  # (B, T) the model turn each column belongs to (its observation: the same), -1 padding
    turn_rewards: list[list[float]]  # (B, turns) the environment's reward for each model turn
    turns: Tensor  # (B,) model turns taken
    tool_calls: Tensor  # (B,) tool calls made
    tool_errors: Tensor  # (B,) of which failed
    turn_limit: Tensor  # (B,) ended by max_turns, the environment not done
    agent: object = None  # agents (gspo.agents.runner.AgentStats): what only agents count (late calls, refusals)
    envs: list | None = None  # (B,) the episodes' environments, as reward functions get them (`environments=`)
    # (B,) bool: episodes that failed (an agent's: it raised, ran out of time, broke the contract): never
    # scored, out of their group's baseline; None: these episodes cannot fail
    failed: Tensor | None = None
    # an episode's later sequences (an agent's forked, concurrent or edited histories: gspo.agents.runner):
    # E rows laid out as the episodes' rows, trained with their episode's advantage; None: none
    more: Rollout | None = None
    more_of: Tensor | None = None  # (E,) the episode of each
    more_turn_index: Tensor | None = None  # (E, T) the episode's model turn each column belongs to

    def with_more(self, ro: Rollout) -> tuple[Rollout, Tensor | None]:
        """`ro` (the B episodes' rows) with the later sequences (E rows) appended on its device, and
        the episode of each of the B + E rows; (ro, None) when there are none."""
        if self.more is None:
            return ro, None
        B, dev = ro.prompt_ids.shape[0], ro.prompt_ids.device
        more = self.more.map(lambda t: t.to(dev))
        both = {f.name: torch.cat([getattr(ro, f.name), getattr(more, f.name)]) for f in dataclasses.fields(Rollout)
                if isinstance(getattr(ro, f.name), torch.Tensor)}
        return dataclasses.replace(ro, **both), torch.cat([torch.arange(B), self.more_of])

    @property
    def env_reward(self) -> Tensor:
        """(B,) the environment's rewards, summed over the episode."""
        return torch.tensor([sum(r) for r in self.turn_rewards], dtype=torch.float32)

    def rewards_to_go(self, max_turns: int) -> Tensor:
        """(B, max_turns): Σ_{k' >= k} of the environment's turn rewards, from each turn on."""
        out = torch.zeros((len(self.turn_rewards), max_turns), dtype=torch.float64)
        for b, rs in enumerate(self.turn_rewards):
            for k in range(len(rs)):
                out[b, k] = sum(rs[k:])
        return out


@dataclass
class _Row:
    segments: list = field(default_factory=list)  # (ids, log-probs or None for the environment's, turn)
    used: int = 0  # tokens after the prompt
    done: bool = False
    truncated: bool = False
    turn_limit: bool = False  # ended by max_turns, the environment not done
    rewards: list = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    final: list = field(default_factory=list)

    def ids(self) -> list[int]:
        return [t for seg in self.segments for t in seg[0]]


def run_episodes(sampler, tokenizer, examples: list, spec: EpisodeSpec, params: SamplingParams,
                 draws: Draws = Draws()) -> tuple[Rollout, Episodes]:
    """`params.group_size` episodes of up to `spec.max_turns` model turns per example with an
    environment `spec.env` (module docstring); `draws`: this process's generators and rows."""
    G, env_cls = params.group_size, spec.env
    B = len(examples) * G
    offset, total = draws.rows or (0, B)
    envs = [start_env(env_cls, examples[b // G]) for b in range(B)]
    tools = tool_schemas(list(getattr(env_cls, "tools", None) or []))
    suffixes = [getattr(env, "prompt_suffix", None) for env in envs]  # reset's text for the prompt (TRL's)
    if any(suffixes):  # each episode its own prompt: turn 0 samples one completion of each
        prompts = encode_prompts(tokenizer, [with_suffix(examples[b // G].prompt, suffixes[b]) for b in range(B)],
                                 spec.max_prompt_length, tools)
    else:
        prompts = [p for p in encode_prompts(tokenizer, [ex.prompt for ex in examples], spec.max_prompt_length, tools)
                   for _ in range(G)]
    state = [_Row() for _ in range(B)]
    at = _Turns(spec, params, tokenizer, tools)
    first = None
    for turn in range(spec.max_turns):
        active = [b for b in range(B) if not state[b].done]
        if (draws.dist.max_int(len(active)) if draws.dist is not None else len(active)) == 0:
            break
        if turn == 0 and any(suffixes):
            ro = first = sampler.sample(prompts, dataclasses.replace(params, group_size=1),
                                        generator=draws.generator_for(0), rows=(offset, total))
            live = list(range(B))
        elif turn == 0:
            ro = first = sampler.sample(prompts[::G], params, generator=draws.generator_for(0), rows=(offset, total))
            live = list(range(B))
        else:
            live = active or [0]  # a stand-in row (its result unused): every process samples every turn
            room = max(1, *(_room(state[b], params.max_new_tokens, spec.max_tokens) for b in live))
            ro = sampler.sample([prompts[b] + state[b].ids() for b in live],
                                dataclasses.replace(params, group_size=1, max_new_tokens=room),
                                generator=draws.generator_for(turn),
                                rows=(torch.tensor([offset + b for b in live]), total))
        ro = cut_at_stop_strings(ro, tokenizer, spec.stop_strings)
        texts = {b: _model_turn(state[b], ro, j, turn, at) for j, b in enumerate(live) if not state[b].done}
        asked = [b for b, text in texts.items() if text is not None]  # the turns that ended reach the env
        steps = run_steps([envs[b] for b in asked], [texts[b] for b in asked],
                          [examples[b // G].source for b in asked], getattr(env_cls, "concurrency", 1))
        for b, step in zip(asked, steps):
            _env_turn(state[b], step, turn, at)
    for env, row, ex in zip(envs, state, (examples[b // G] for b in range(B))):
        _finish(env, row, ex)
    ro, ep = _assemble(first, state, tokenizer, G)
    ep.envs = [env.user_object() if hasattr(env, "user_object") else env for env in envs]
    return ro, ep


def with_suffix(prompt, suffix: str | None):
    """The prompt with `suffix` appended to its last message (a chat prompt) or its text."""
    if not suffix:
        return prompt
    if isinstance(prompt, list):
        return [*prompt[:-1], {**prompt[-1], "content": str(prompt[-1].get("content") or "") + suffix}]
    return prompt + suffix


def _finish(env, row: _Row, example) -> None:
    """The environment's `finish()` (optional), once its episode ended: added to its last turn's reward."""
    finish = getattr(env, "finish", None)
    if not callable(finish):
        return
    try:
        reward = float(finish())
    except Exception as e:
        raise EnvError(f"env {type(env).__name__}: finishing the episode on {example.source or 'a row'} raised "
                       f"{type(e).__name__}: {e}") from None
    if row.rewards:
        row.rewards[-1] += reward
    else:
        row.rewards.append(reward)


def start_env(env_cls, example):
    """A new environment for one episode, reset to its dataset row."""
    try:
        env = env_cls()
        env.reset(example)
    except Exception as e:
        raise EnvError(f"env {getattr(env_cls, '__name__', env_cls)}: reset on {example.source or 'a row'} raised "
                       f"{type(e).__name__}: {e}") from None
    return env


def _room(row: _Row, max_new_tokens: int, max_tokens: int) -> int:
    return min(max_new_tokens, max_tokens - row.used) if max_tokens > 0 else max_new_tokens


def _model_turn(row: _Row, ro: Rollout, j: int, turn: int, at: _Turns) -> str | None:
    """Row j of this turn's rollout becomes the episode's next model turn: its text for the
    environment, or None when the turn did not end (cut by a budget: the episode is truncated)."""
    n = min(int(ro.lengths[j]), _room(row, at.params.max_new_tokens, at.spec.max_tokens))
    ids, logp = ro.completion_ids[j, :n].tolist(), ro.logp[j, :n].tolist()
    row.segments.append((ids, logp, turn))
    row.used += n
    row.final = ids
    if n < int(ro.lengths[j]) or bool(ro.truncated[j]):
        row.rewards.append(0.0)
        row.done = row.truncated = True
        return None
    return at.tokenizer.decode(ids, skip_special_tokens=True)


def _env_turn(row: _Row, step: Step, turn: int, at: _Turns) -> None:
    """The environment's answer to the episode's last model turn, appended as its tokens."""
    row.rewards.append(float(step.reward))
    row.calls, row.errors = row.calls + step.tool_calls, row.errors + step.tool_errors
    if step.done or turn == at.spec.max_turns - 1:
        row.done, row.turn_limit = True, not step.done
        return
    ids, tokenizer, max_tokens = row.final, at.tokenizer, at.spec.max_tokens
    stopped = tokenizer.decode(ids[-1:]) if ids and ids[-1] in at.params.stop_token_ids else None
    text = observation_text(tokenizer, step.messages, at.tools, stopped)
    obs = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens > 0 and row.used + len(obs) >= max_tokens:  # no room left for the next turn
        row.done = row.truncated = True
        return
    row.segments.append((obs, None, turn))
    row.used += len(obs)


def run_steps(envs: list, texts: list[str], sources: list[str], concurrency: int = 1) -> list[Step]:
    """Each environment's step on its episode's model turn, in order; `concurrency` > 1 runs up
    to that many at once in threads (an environment class that waits on I/O says so with its
    `concurrency` attribute). The first failure, in episode order, is raised either way."""
    if concurrency <= 1 or len(envs) <= 1:
        return [_step(env, text, source) for env, text, source in zip(envs, texts, sources)]
    with ThreadPoolExecutor(max_workers=min(concurrency, len(envs)), thread_name_prefix="gspo-env") as pool:
        return list(pool.map(_step, envs, texts, sources))


def _step(env, text: str, source: str) -> Step:
    name = type(env).__name__
    try:
        step = env.step(text)
    except Exception as e:
        raise EnvError(f"env {name}: step on {source or 'a row'} raised {type(e).__name__}: {e} "
                       f"(a tool's error should become an observation: "
                       f"gspo.tasks.env.ToolEnvironment does that)") from None
    if not isinstance(step, Step):
        raise EnvError(f"env {name}: step returned {type(step).__name__}, expected a gspo.tasks.env.Step")
    bad = [m for m in step.messages if not (isinstance(m, dict) and "role" in m and "content" in m)]
    if bad:
        raise EnvError(f"env {name}: step returned a message {bad[0]!r}; expected {{'role': ..., 'content': ...}}")
    return step


def lay_out(rows: list[list], pad: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Each row's segments (ids, log-probs or None for the environment's, turn) side by side:
    (B, T) ids, model mask, environment mask, log-probs and turn index (-1 on padding)."""
    B, T = len(rows), max(1, *(sum(len(seg[0]) for seg in row) for row in rows))
    ids = torch.full((B, T), pad, dtype=torch.long)
    model, env, logp = torch.zeros((B, T)), torch.zeros((B, T)), torch.zeros((B, T), dtype=torch.float32)
    turn_index = torch.full((B, T), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        at = 0
        for seg_ids, seg_logp, turn in row:
            cols = slice(at, at + len(seg_ids))
            ids[b, cols] = torch.tensor(seg_ids, dtype=torch.long)
            turn_index[b, cols] = turn
            if seg_logp is None:
                env[b, cols] = 1.0
            else:
                model[b, cols] = 1.0
                logp[b, cols] = torch.tensor(seg_logp, dtype=torch.float32)
            at += len(seg_ids)
    return ids, model, env, logp, turn_index


def _assemble(first: Rollout, state: list[_Row], tokenizer, G: int) -> tuple[Rollout, Episodes]:
    """The episodes laid out as a Rollout (model and environment tokens after the prompt)."""
    ids, model, env, logp, turn_index = lay_out([row.segments for row in state], tokenizer.pad_token_id)
    dev = first.completion_ids.device
    ro = Rollout(first.prompt_ids, first.prompt_mask, ids.to(dev), model.to(dev), logp.to(dev),
                 torch.tensor([row.used for row in state], device=dev),
                 torch.tensor([row.truncated for row in state], device=dev), G, None, env.to(dev))
    ep = Episodes(final_texts=tokenizer.batch_decode([row.final for row in state], skip_special_tokens=True),
                  final_ids=[row.final for row in state],
                  transcripts=[tokenizer.decode(row.ids()) for row in state],
                  turn_index=turn_index.to(dev), turn_rewards=[row.rewards for row in state],
                  turns=torch.tensor([len(row.rewards) for row in state]),
                  tool_calls=torch.tensor([row.calls for row in state]),
                  tool_errors=torch.tensor([row.errors for row in state]),
                  turn_limit=torch.tensor([row.turn_limit for row in state]))
    return ro, ep
