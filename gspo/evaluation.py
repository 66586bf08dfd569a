"""Held-out evaluation: greedy accuracy (and pass@k) on a task's evaluation rows.

    from gspo.evaluation import evaluate
    evaluate(model, tokenizer, task, rewards, n=500)        # {"accuracy": 0.62, "reward": 0.62, "n": 500}
    evaluate(model, tokenizer, task, rewards, n=500, k=8)   # adds "pass@8" and "sample_accuracy"

`accuracy` is the mean of the *first* reward over greedy completions (for a 0/1 verifier, the
fraction answered correctly; `binary` says whether every value was 0 or 1, `metric` names the
reward; rows where it returned None are left out); `reward` is the mean weighted sum of all rewards. `pass@k` is
the fraction of rows where at least one of k samples (at `temperature`) gets a first reward
of 1; `sample_accuracy` the mean first reward over those samples.
"""

from __future__ import annotations

import sys

import torch

from gspo.episodes import run_episodes
from gspo.rewards import Reward, score_completions
from gspo.rollout import (PolicySampler, cut_at_stop_strings, decode_completions, encode_prompts, generate,
                          sampling_params, stop_token_ids)


@torch.no_grad()
def evaluate(model, tokenizer, task, rewards: list[Reward], *, n: int = 500, k: int = 0, temperature: float = 1.0,
             max_new_tokens: int = 8, batch_size: int = 128, seed: int = 0, progress: bool = False,
             dist=None, stop: tuple[int, ...] | None = None, max_prompt_length: int = 0,
             stop_strings: tuple[str, ...] = (), env=None, max_turns: int = 1, max_episode_tokens: int = 0) -> dict:
    """dist (gspo.distributed.Dist): each process evaluates its contiguous share of the rows
    and the sums are added up; every process returns the same result. stop: the stop token
    ids (default: the tokenizer's EOS and the model's generation config's, `stop_token_ids`).
    The pass@k samples draw from a CPU generator whatever the model's device (the sampler
    draws its uniforms on the CPU). env: an environment class (gspo.env): each row is then an
    episode of up to `max_turns` model turns (gspo.episodes), scored on its final model turn."""
    all_examples = task.test_set(n)
    lo, hi = dist.share(len(all_examples)) if dist is not None else (0, len(all_examples))
    examples = all_examples[lo:hi]
    first = rewards[0].name
    acc = total = pass_k = sample_acc = applied = 0.0
    binary = True  # every first-reward value seen is 0 or 1: a verifier, and `accuracy` is a share correct
    gen = torch.Generator().manual_seed(seed)
    stop = stop or stop_token_ids(tokenizer, model)
    greedy = sampling_params(tokenizer, stop=stop, group_size=1, max_new_tokens=max_new_tokens, temperature=0.0)
    sampled = sampling_params(tokenizer, stop=stop, group_size=k, max_new_tokens=max_new_tokens,
                              temperature=temperature)
    starts = range(0, len(examples), batch_size)
    if progress and len(starts) > 1 and sys.stderr.isatty():
        from tqdm import tqdm

        starts = tqdm(starts, desc="gspo eval", unit="batch", leave=False)
    for start in starts:
        chunk = examples[start:start + batch_size]
        episode = dict(env=env, max_turns=max_turns, max_tokens=max_episode_tokens, stop_strings=stop_strings,
                       max_prompt_length=max_prompt_length)
        texts, ids = _complete(model, tokenizer, chunk, greedy, None, **episode)
        weighted, per = score_completions(rewards, chunk, texts, ids, 1)
        values = [v for v in per[first] if v == v]  # None (NaN): the reward does not apply to that row
        acc, applied, total = acc + sum(values), applied + len(values), total + sum(weighted)
        binary = binary and all(v in (0.0, 1.0) for v in values)
        if k > 0:
            texts, ids = _complete(model, tokenizer, chunk, sampled, gen, **episode)
            _, per = score_completions(rewards, chunk, texts, ids, k)
            r = torch.tensor(per[first]).view(len(chunk), k)
            pass_k += float((r >= 1.0).any(1).sum())
            sample_acc += float(r.mean(1).sum())
    if dist is not None and dist.enabled:
        acc, total, pass_k, sample_acc, applied, binary = dist.all_sum(torch.tensor(
            [acc, total, pass_k, sample_acc, applied, float(not binary)], dtype=torch.float64)).tolist()
        binary = binary == 0
    n_all = len(all_examples)
    out = {"accuracy": acc / max(applied, 1), "reward": total / n_all, "n": n_all, "metric": first,
           "binary": bool(binary)}
    if k > 0:
        out[f"pass@{k}"] = pass_k / n_all
        out["sample_accuracy"] = sample_acc / n_all
    return out


def _complete(model, tokenizer, examples, params, generator, *, env, max_turns: int, max_tokens: int,
              stop_strings: tuple[str, ...], max_prompt_length: int) -> tuple[list[str], list[list[int]]]:
    """The texts and token ids the rewards score: single-turn completions, or (env) the final
    model turn of each episode."""
    if env is not None:
        _, ep = run_episodes(PolicySampler(model), tokenizer, examples, env, params, max_turns=max_turns,
                             max_tokens=max_tokens, generator_for=lambda turn: generator, stop_strings=stop_strings,
                             max_prompt_length=max_prompt_length)
        return ep.final_texts, ep.final_ids
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in examples], max_prompt_length)
    ro = cut_at_stop_strings(generate(model, prompts, params, generator=generator), tokenizer, stop_strings)
    return decode_completions(tokenizer, ro)
