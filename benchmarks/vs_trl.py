"""gspo against TRL's GRPOTrainer (its GSPO mode) on identical work: step time, rollout time, memory.

    pip install -e ".[bench]"                 # TRL is a benchmark-only dependency
    python benchmarks/vs_trl.py               # tiny and mid, 3 alternating repeats each (~25 min, 2 CPU cores)
    python benchmarks/vs_trl.py --configs mid --repeats 2 --steps 3
    python benchmarks/vs_trl.py --configs 0.5b --vllm   # GPU: both sides sample with colocated vLLM

Identical work on both sides: the same locally built Qwen3 (benchmarks/common.py), the same
arithmetic prompts in the same order, `group_size` completions per prompt, `prompts` prompts
per step, every completion forced to exactly `new_tokens` tokens (EOS banned until then:
`min_new_tokens`), fp32 on CPU (bf16 on CUDA for `--configs 0.5b`), 4 minibatches per rollout. A "step" is one rollout batch and
all the minibatch updates it feeds: for TRL, `steps_per_generation=4` optimizer steps.

TRL runs with its fastest settings here: `importance_sampling_level="sequence"`,
`loss_type="grpo"`, `beta=0` (no reference model), gradient checkpointing off, no logging of
completions, no evaluation, no checkpointing. gspo runs with its defaults for this work
(`--old-logp auto`: the sampling pass's fp32 log-probs, no recomputation pass).

With `--vllm` both sides sample with a vLLM engine colocated in the trainer's process: gspo
`--rollout-engine vllm`, TRL `use_vllm=True, vllm_mode="colocate"` (each with 0.3 of the GPU
for the engine). TRL's rollout time is then not measured (its engine bypasses `generate`).
TRL supports only some vLLM versions (0.10.2 to 0.17 at TRL 1.x); install one both accept.

Each side runs in its own process; runs alternate (gspo, TRL, gspo, TRL, ...) so both share
the machine's noise. Reported per side: the median step time and median rollout (sampling)
time over all timed steps of all repeats (the first step of each run warms up and is not
timed), the peak resident memory of the process, and model FLOPs per step (2·params per
generated token + 6·params per trained token) divided by the step time, as a share of the
machine's measured fp32 matmul peak. A second table says where each side's step goes: the
rollout (sampling and scoring), the old-policy pass (gspo: `time/prepare_seconds`, the batch's
preparation; TRL: its forwards without gradient after each generation) and the update (the rest).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from common import ROOT, model_path, n_params, peak_rss_mb

CONFIGS = {
    # name: (model, prompts per step, group size, new tokens)
    "tiny": ("tiny", 8, 8, 32),
    "mid": ("mid", 4, 8, 128),
    "0.5b": ("0.5b", 8, 8, 256),  # GPU only: bf16 on CUDA (not measured yet: no GPU was lent while writing this)
}
GPU_CONFIGS = {"0.5b"}


def prompts_for(n_steps: int, per_step: int) -> list[dict]:
    from gspo.tasks import get_task

    task = get_task("arithmetic")
    return [{"prompt": ex.prompt, "answer": ex.answer} for s in range(1, n_steps + 1)
            for ex in task.train_batch(s, per_step, seed=0)]


def exact(completions, answer, **kw):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]


def run_gspo(args) -> dict:
    import torch

    from gspo.config import TrainConfig
    from gspo.resolve import resolve
    from gspo.run import build_run
    from gspo.trainer import train_step

    torch.set_num_threads(args.threads)
    model, P, G, L = CONFIGS[args.config]
    gpu = args.config in GPU_CONFIGS
    cfg = resolve(TrainConfig(model=model_path(model), prompts_per_step=P, group_size=G, max_new_tokens=L,
                              min_new_tokens=L, num_minibatches=4, lr=1e-5, output_dir="-", progress=False, threads=args.threads,
                              device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                              rollout_engine="vllm" if args.vllm else "hf", vllm_gpu_memory_utilization=0.3))
    run = build_run(cfg)
    steps, rollouts, old_passes = [], [], []
    for step in range(1, args.steps + 2):
        t = time.perf_counter()
        m, _ = train_step(run, step)
        if step > 1:
            steps.append(time.perf_counter() - t)
            rollouts.append(m["time/rollout_seconds"])
            old_passes.append(m["time/prepare_seconds"])  # old-policy pass (none with --old-logp auto) + advantages
    return {"steps": steps, "rollouts": rollouts, "old_passes": old_passes, "params": n_params(run.policy)}


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
    path = model_path(model_name)
    from gspo.models import resolve_model_path

    path = str(resolve_model_path(path))
    gpu = args.config in GPU_CONFIGS
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if gpu else torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    n_steps = args.steps + 1
    ds = Dataset.from_list(prompts_for(n_steps, P))
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
        trainer = GRPOTrainer(model=model, reward_funcs=exact, args=cfg, train_dataset=ds, processing_class=tok,
                              callbacks=[Marks()])
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
    return {"steps": steps, "rollouts": rollouts[1:], "old_passes": per_batch[1:], "params": n_params(model)}


def worker(args) -> None:
    import torch  # noqa: F401  (imported before the baseline)

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,mid")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per run (after one warm-up step)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="both sides sample with colocated vLLM (GPU)")
    ap.add_argument("--side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return worker(args)

    peak = matmul_peak(args.threads)
    print(f"machine: {args.threads} threads, fp32 matmul peak {peak:.0f} GFLOP/s\n")
    print("| config | side | median step (s) | median rollout (s) | peak RSS (MiB) | model FLOP/s | % of peak |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    summary, breakdown = {}, {}
    for config in args.configs.split(","):
        model, P, G, L = CONFIGS[config]
        model_path(model)
        results = {"gspo": [], "trl": []}
        for _ in range(args.repeats):
            for side in ("gspo", "trl"):
                cmd = [sys.executable, __file__, "--side", side, "--config", config, "--steps", str(args.steps),
                       "--threads", str(args.threads)] + (["--vllm"] if args.vllm else [])
                out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT / "benchmarks")
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
                if out.returncode != 0 or not line:
                    raise SystemExit(f"{side} {config} failed:\n{out.stderr[-3000:]}")
                results[side].append(json.loads(line[0][7:]))
        for side in ("gspo", "trl"):
            rs = results[side]
            step = statistics.median([x for r in rs for x in r["steps"]])
            roll = statistics.median([x for r in rs for x in r["rollouts"]] or [float("nan")])
            rss = max(r["peak_rss_mb"] for r in rs)
            N = rs[0]["params"]
            prompt_len = 8  # at most: "999-999=" (the FLOP count uses the longest)
            flops = 2 * N * P * G * L + 6 * N * P * G * (prompt_len + L)
            summary[(config, side)] = step
            print(f"| {config} | {side} | {step:.2f} | {roll:.2f} | {rss:.0f} | {flops / step / 1e9:.1f} G | "
                  f"{100 * flops / step / 1e9 / peak:.1f}% |", flush=True)
        print(f"| {config} | **TRL / gspo step time** | **{summary[(config, 'trl')] / summary[(config, 'gspo')]:.2f}x** "
              "| | | | |", flush=True)
        breakdown[config] = {side: _where(results[side]) for side in ("gspo", "trl")}
    print("\nWhere a step's time goes (medians, seconds; update = the rest: the minibatches' forward and backward "
          "passes and optimizer steps):\n")
    print("| config | side | rollout (sampling + scoring) | old-policy pass | update | step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for config, sides in breakdown.items():
        for side, (roll, old, upd, step) in sides.items():
            print(f"| {config} | {side} | {roll:.2f} | {old:.2f} | {upd:.2f} | {step:.2f} |")


def _where(runs: list[dict]) -> tuple[float, float, float, float]:
    """(rollout, old-policy pass, update, step): medians over every timed step of every run;
    the update is the step's median less the other two."""
    med = [statistics.median([x for r in runs for x in r[key]] or [0.0]) for key in ("rollouts", "old_passes", "steps")]
    return med[0], med[1], med[2] - med[0] - med[1], med[2]


if __name__ == "__main__":
    main()
