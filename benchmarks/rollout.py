"""Rollout throughput: gspo's sampling loop against Hugging Face `model.generate` and vLLM.

    python benchmarks/rollout.py                       # tiny and mid, ~2 minutes on 2 CPU cores
    python benchmarks/rollout.py --configs mid --repeats 5
    .venv-vllm/bin/python benchmarks/rollout.py        # with a vLLM column (the vLLM environment)

Same model, same prompts, same batch: `prompts` prompts x `group_size` samples, every
completion exactly `new_tokens` long (EOS banned until then), sampling from the full
temperature-1 distribution on both sides (`model.generate(do_sample=True, top_k=0, top_p=1)`;
HF's default top_k=50 would sample from a different distribution). The two alternate,
`repeats` times each after a warm-up, in one process; reported: median generated tokens per
second and the ratio.

Where gspo's loop wins: inverse-CDF sampling (one uniform per row instead of
torch.multinomial's exponential draw over the whole vocabulary), one prefill per prompt
shared by its group, the LM head applied to the last position only, no logits processors, a
pre-allocated attention mask.

The vLLM column (when vLLM is installed) is gspo's `--rollout-engine vllm`: the same batch as
`n = samples` requests with `min_tokens = max_tokens`, the engine built once (its start-up is
not timed) and synced with the model's weights before every timed rollout, as in training.
On CPU it measures vLLM's CPU backend, not what it does on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import model_path

CONFIGS = {"tiny": ("tiny", 8, 8, 32), "mid": ("mid", 4, 8, 128)}


def vllm_side(model, tok, prompts, G: int, L: int):
    """A timed rollout on a colocated vLLM engine (synced before each), or None without vLLM."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return None
    import torch

    from gspo.config import VLLM
    from gspo.sampling.rollout import sampling_params
    from gspo.sampling.vllm_engine import VLLMSampler

    engine = VLLMSampler(model.name_or_path, VLLM(vllm_max_model_len=int(model.config.max_position_embeddings)),
                         dtype="float32", seed=0)
    params = sampling_params(tok, group_size=G, max_new_tokens=L, min_new_tokens=L)
    g = torch.Generator().manual_seed(0)

    def run():
        engine.sync(model)
        ro = engine.sample(prompts, params, generator=g)
        assert int(ro.lengths.min()) == L

    return run


def gspo_side(model, tok, prompts, G: int, L: int, g):
    """A timed rollout with gspo's own generate, sampling with the generator g."""
    from gspo.sampling.rollout import generate, sampling_params

    def ours():
        generate(model, prompts, sampling_params(tok, group_size=G, max_new_tokens=L, min_new_tokens=L), generator=g)

    return ours


def hf_side(model, tok, ids, mask, L: int):
    """A timed rollout with transformers' model.generate on the left-padded ids and mask."""
    import torch

    def hf():
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                                 temperature=1.0, max_new_tokens=L, min_new_tokens=L,
                                 pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        assert out.shape[1] == ids.shape[1] + L

    return hf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from gspo.models.loading import load_policy
    from gspo.models.sequences import left_pad
    from gspo.tasks import get_task

    torch.set_num_threads(args.threads)
    print("| config | batch (prompts x samples x tokens) | gspo tokens/s | model.generate tokens/s | ratio | "
          "vLLM tokens/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for config in args.configs.split(","):
        name, P, G, L = CONFIGS[config]
        model, tok = load_policy(model_path(name))
        prompts = [tok(ex.prompt)["input_ids"] for ex in get_task("arithmetic").train_batch(1, P)]
        ids, mask = left_pad(prompts, tok.pad_token_id)
        ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
        g = torch.Generator().manual_seed(0)
        sides = {"gspo": gspo_side(model, tok, prompts, G, L, g), "hf": hf_side(model, tok, ids, mask, L)}
        engine = vllm_side(model, tok, prompts, G, L)
        if engine is not None:
            sides["vllm"] = engine
        for fn in sides.values():  # warm-up
            fn()
        times = {side: [] for side in sides}
        for _ in range(args.repeats):
            for side, fn in sides.items():
                t = time.perf_counter()
                fn()
                times[side].append(time.perf_counter() - t)
        n = P * G * L
        a, b = n / statistics.median(times["gspo"]), n / statistics.median(times["hf"])
        c = f"{n / statistics.median(times['vllm']):.0f}" if "vllm" in times else "n/a (not installed)"
        print(f"| {config} | {P} x {G} x {L} | {a:.0f} | {b:.0f} | {a / b:.2f}x | {c} |", flush=True)


if __name__ == "__main__":
    main()
