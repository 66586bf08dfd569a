"""Held-out evaluation: greedy accuracy and pass@k on a task's test split.

    from gspo.evaluation import evaluate
    evaluate(model, tokenizer, task, n=500)            # {"accuracy": 0.62, "n": 500}
    evaluate(model, tokenizer, task, n=500, k=8)       # adds "pass@8" and "sample_accuracy"

pass@k uses the unbiased estimator of Chen et al. (2021) from k samples per problem at the
given temperature: with k samples it is the fraction of problems with at least one correct.
"""

from __future__ import annotations

import torch

from gspo.rollout import generate


def encode_prompts(tokenizer, prompts: list[str]) -> list[list[int]]:
    return [tokenizer(p)["input_ids"] for p in prompts]


@torch.no_grad()
def evaluate(model, tokenizer, task, *, n: int = 500, k: int = 0, temperature: float = 1.0,
             max_new_tokens: int = 8, batch_size: int = 256, seed: int = 0) -> dict:
    problems = task.test_set(n)
    correct = 0.0
    pass_k = 0.0
    sample_correct = 0.0
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        prompts = encode_prompts(tokenizer, [p.prompt for p in chunk])
        ro = generate(model, prompts, group_size=1, max_new_tokens=max_new_tokens, temperature=0.0,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
        correct += sum(task.reward(c, p) for c, p in zip(texts, chunk))
        if k > 0:
            ro = generate(model, prompts, group_size=k, max_new_tokens=max_new_tokens, temperature=temperature,
                          eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, generator=gen)
            texts = tokenizer.batch_decode(ro.completion_ids, skip_special_tokens=True)
            r = torch.tensor([task.reward(c, chunk[i // k]) for i, c in enumerate(texts)]).view(len(chunk), k)
            pass_k += float((r.max(1).values > 0).sum())
            sample_correct += float(r.mean(1).sum())
    out = {"accuracy": correct / len(problems), "n": len(problems)}
    if k > 0:
        out[f"pass@{k}"] = pass_k / len(problems)
        out["sample_accuracy"] = sample_correct / len(problems)
    return out
