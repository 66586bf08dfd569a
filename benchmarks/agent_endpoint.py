"""The agent endpoint's overhead: the same episodes sampled directly and through the OpenAI endpoint.

    python benchmarks/agent_endpoint.py [--model tiny-tool] [--episodes 64] [--tokens 32] [--repeats 3]
                                        [--engine gspo|vllm]

Direct: one sampler.sample call over every prompt (what a single-turn rollout does), with gspo's
own sampler (PolicySampler) or the vLLM engine (VLLMSampler, float32; run it in the vLLM
environment, docs/vllm.md).
Endpoint: gspo.agents.runner.run_agent_episodes with an agent making one chat call per
episode through openai.AsyncOpenAI, so the HTTP server, JSON, chat-template rendering, the
batching window and the event loop are all in the time. Prints completion tokens per second of
each (median over repeats) and the ratio. Both sample the same prompts with the same settings;
the endpoint's batches are whatever arrived together (printed).
"""

import argparse
import statistics
import time

import torch

from gspo.agents.runner import run_agent_episodes
from gspo.models.loading import load_policy
from gspo.sampling.episodes import Draws, EpisodeSpec
from gspo.sampling.rollout import PolicySampler, encode_prompts, sampling_params
from gspo.tasks.data import Example


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-tool")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine", choices=["gspo", "vllm"], default="gspo")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_policy(a.model)
    stop = (tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id)
    params = sampling_params(tok, stop=stop, group_size=1, max_new_tokens=a.tokens, min_new_tokens=a.tokens - 1)
    examples = [Example(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(a.episodes)]
    sampler = PolicySampler(model) if a.engine == "gspo" else vllm_sampler(a.model, model)

    async def agent(client, example):
        r = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.prompt}])
        return float(r.choices[0].message.content == example.answer)

    def direct():
        prompts = encode_prompts(tok, [[{"role": "user", "content": ex.prompt}] for ex in examples])
        ro = sampler.sample(prompts, params)
        sampler.end_rollout()
        return int(ro.lengths.sum())

    def endpoint():
        ro, _ = run_agent_episodes(sampler, tok, examples, EpisodeSpec(agent, max_turns=1, timeout=600),
                                   params, Draws())
        sampler.end_rollout()
        return int(ro.completion_mask.sum())

    rates = {}
    for name, fn in [("direct", direct), ("endpoint", endpoint)]:
        fn()  # warm-up
        xs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            n = fn()
            xs.append(n / (time.perf_counter() - t0))
        rates[name] = statistics.median(xs)
        print(f"{name:9s} {rates[name]:8.0f} completion tokens/s (median of {a.repeats}; {n} tokens a rollout)")
    print(f"endpoint / direct: {rates['endpoint'] / rates['direct']:.2f} "
          f"({a.episodes} episodes of one call, {a.tokens} tokens each, model {a.model}, engine {a.engine}, "
          f"{torch.get_num_threads()} threads)")


def vllm_sampler(name: str, model):
    """The vLLM engine over `name`'s weights, synced from `model` (as a training run's first rollout)."""
    from gspo.config import VLLM
    from gspo.models.loading import resolve_model_path
    from gspo.sampling.vllm_engine import VLLMSampler

    engine = VLLMSampler(str(resolve_model_path(name)),
                         VLLM(vllm_max_model_len=int(model.config.max_position_embeddings)), dtype="float32", seed=0)
    engine.sync(model)
    return engine


if __name__ == "__main__":
    main()
