"""The training configuration: one typed dataclass, the single source of truth.

Each field's docstring is its `--help` text (parsed by `tyro`). A run's configuration comes
from, in order: the defaults below, then a YAML file (`--config run.yaml`, keys are the field
names), then command-line flags (`--group-size 16`). Fields left as None are derived after
parsing (`resolve`): the clip range comes from the algorithm's preset. The resolved config is
saved as `config.yaml` in the run directory and in every checkpoint.

Checking: every value is checked against its field's type annotation by pydantic (strict:
`steps="2"` is an error, not 2; lists become tuples; gspo.configfile) wherever it comes from (YAML, the Python
API; the CLI is tyro's), then `validate` checks ranges and combinations. Either way a bad
value is a `ConfigError` with a one-line message naming the field, before any work starts.

    from gspo.config import TrainConfig, resolve
    cfg = resolve(TrainConfig(algorithm="grpo", steps=50))
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


from gspo.losses import AGG_MODES

Algorithm = Literal["gspo", "grpo", "gspo_token", "ppo", "cispo", "sapo", "gmpo"]

# Clip ranges (clip_low, clip_high): the paper's §5.1 for gspo and grpo; gspo_token shares
# GSPO's ranges because its ratio has the same value s_i; ppo uses the classic symmetric 0.2.
# The successors follow their papers: CISPO (MiniMax-M1) sets no lower bound on the IS weight
# (clip_low 1.0 -> 0) and tunes the upper, 0.28 as verl/Trinity's defaults; GMPO clips log-ratios
# to [-0.4, 0.4] (its paper's (e^-0.4, e^0.4)); SAPO clips nothing (its gate temperatures are
# --sapo-tau-pos/--sapo-tau-neg, 1.0 and 1.05 as in its paper).
PRESETS: dict[str, dict] = {
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4},
    "grpo": {"clip_low": 0.2, "clip_high": 0.27},
    "gspo_token": {"clip_low": 3e-4, "clip_high": 4e-4},
    "ppo": {"clip_low": 0.2, "clip_high": 0.2},
    "cispo": {"clip_low": 1.0, "clip_high": 0.28},
    "sapo": {"clip_low": 0.0, "clip_high": 0.0},
    "gmpo": {"clip_low": 0.4, "clip_high": 0.4},
}
LOG_SPACE_CLIP = ("gmpo",)  # clip ranges of log-ratios, not of ratios


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field."""


@dataclass
class TrainConfig:
    # --- what to train -------------------------------------------------------------------
    algorithm: Algorithm = "gspo"
    """Policy loss: gspo (sequence ratio, paper Eq. 5), grpo (token ratios, Eq. 2), gspo_token (Eq. 13), ppo (token ratios with GAE advantages from a learned value model, Eq. 1), or the successors cispo (clipped IS weights, MiniMax-M1), sapo (soft gate, Qwen) and gmpo (geometric mean, log-space clip). Sets the preset clip range."""
    model: str | None = None
    """Default: the task's model (tiny-long for chain, tiny-tool for calculator), else tiny. A Hugging Face Hub id (Qwen/Qwen2.5-0.5B-Instruct: downloaded, or read from the local cache offline), the path of a local Hugging Face causal LM directory, or a built-in model name (tiny, a dense Qwen3; tiny-moe, a Qwen3-MoE; tiny-long and tiny-long-moe, the same for the chain task; tiny-tool, a chat model that calls tools, for the calculator task)."""
    revision: str | None = None
    """Hub revision of --model (a branch, tag or commit hash; None: main); also used for the reference model and PPO's critic."""
    task: str = "arithmetic"
    """Built-in task: arithmetic (sums and differences of 3-digit numbers), addition, chain (long answers: count up from a in steps of d to 1000, every step written out, 55-217 tokens; its model, tiny-long, is the default; tiny-long-moe is its MoE twin), or calculator (multi-turn: two-digit products with a calculator tool; its model, tiny-tool, is the default). Ignored with --dataset."""

    # --- your own data and rewards -------------------------------------------------------
    dataset: str | None = None
    """Training data: a Hugging Face Hub dataset id (openai/gsm8k: downloaded, or read from the local cache offline), a .jsonl, .json, .csv, .tsv or .parquet file, or a datasets directory (save_to_disk or data files). None: the built-in --task."""
    dataset_config: str | None = None
    """Configuration (subset) of a Hub dataset, e.g. main for openai/gsm8k (None: its default)."""
    dataset_split: str = "train"
    """Split to train on, for a dataset directory with several splits."""
    eval_dataset: str | None = None
    """Evaluation data (same formats). None: --eval-split if given, else a fixed held-out slice of --dataset."""
    eval_split: str | None = None
    """Split to evaluate on, for a dataset directory with several splits (e.g. test)."""
    prompt_column: str = "prompt"
    """Dataset column holding the prompt: a string, or a list of chat messages (gets the chat template)."""
    system_prompt: str | None = None
    """A system message: string prompts become chat messages (this system turn, then the prompt as the user's turn) and get the chat template; prompts that are already chat messages get it as their first turn unless they have one."""
    max_prompt_length: int = 0
    """Longest prompt, in tokens (after the chat template): longer prompts keep their last max_prompt_length tokens (as TRL truncates), and a warning counts them; 0 = no limit."""
    answer_column: str = "answer"
    """Dataset column holding the reference answer (string or number) that rewards compare to; passed to rewards as `answer`."""
    reward: tuple[str, ...] = ()
    """Rewards: built-in names (exact_match, exact_integer, numeric_match, math_verify, format, length), module:function / file.py:function, or a learned reward model (an AutoModelForSequenceClassification directory or Hub id, scored on prompt + completion with its own tokenizer and chat template). Empty: the task's default (exact_integer for the built-in tasks, exact_match for a dataset). The first reward is the accuracy reported by evaluation."""
    reward_weights: tuple[float, ...] = ()
    """One weight per --reward; the training reward is their weighted sum (empty: all 1)."""
    reward_model_device: str | None = None
    """Device of learned reward models (a --reward naming an AutoModelForSequenceClassification): cpu, cuda, cuda:N (None: the policy's device)."""
    reward_model_batch_size: int = 32
    """Completions a learned reward model scores per forward pass."""
    format_pattern: str = r"<think>.*?</think>\s*<answer>.*?</answer>"
    """Regular expression the whole completion must match for the `format` reward."""

    # --- rollout --------------------------------------------------------------------------
    steps: int | None = None
    """Training steps; each step is one rollout batch and all the updates it feeds (None: the task's default, 60; 20 for calculator)."""
    prompts_per_step: int = 32
    """Distinct prompts sampled per step."""
    group_size: int = 8
    """Completions sampled per prompt (G); advantages are relative to the group."""
    max_new_tokens: int | None = None
    """Longest completion, in tokens; longer ones are cut and marked truncated (None: the task's default, 8 for arithmetic, 256 for a dataset)."""
    min_new_tokens: int = 0
    """EOS cannot be sampled before this many tokens (min = max fixes every completion's length, for benchmarks)."""
    temperature: float = 1.0
    """Sampling temperature; the same temperature scales the logits of training log-probs."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    top_k: int = 0
    """Sample only among the k most likely tokens (0 = off). Like top-p it limits what can be drawn; log-probs stay those of the full distribution."""
    stop_string: tuple[str, ...] = ()
    """Strings that end a completion (e.g. "</answer>"): it is cut after the token that completes the first one (the sampler may run past it; those tokens are dropped)."""
    stop_token: tuple[str, ...] = ()
    """More tokens that end a completion (e.g. <|im_end|>); the tokenizer's EOS and the model's generation_config.eos_token_id always do."""

    # --- multi-turn episodes ---------------------------------------------------------------
    env: str | None = None
    """Environment for multi-turn episodes (docs/multiturn.md): path/to/file.py:ClassName or package.module:ClassName. Default: the task's own (calculator: its calculator tool), else single-turn."""
    max_turns: int | None = None
    """Model turns per episode at most (None: the task's default, 3 for calculator; 1 without an environment)."""
    max_episode_tokens: int = 0
    """Token budget of an episode after the prompt, model and environment tokens together (0 = what the model's positions leave after the longest prompt); an episode that reaches it ends, flagged truncated."""
    turn_advantages: bool = False
    """Per-turn advantages: each model turn's tokens get the group-normalised reward from that turn on (the environment's turn rewards from there plus the final reward), for token-level losses (gspo_token, grpo, cispo, sapo); off: one advantage per episode."""

    # --- policy update -------------------------------------------------------------------
    num_minibatches: int = 4
    """Minibatches per rollout batch; the paper uses 4, so all but the first update are off-policy."""
    epochs: int = 1
    """Passes over the rollout batch."""
    clip_low: float | None = None
    """Ratio clipped below at 1 - clip_low (None: the algorithm's preset, 3e-4 for gspo, 0.2 for grpo)."""
    clip_high: float | None = None
    """Ratio clipped above at 1 + clip_high (None: the algorithm's preset, 4e-4 for gspo, 0.27 for grpo)."""
    loss_agg: str = "seq-mean-token-mean"
    """Loss aggregation: seq-mean-token-mean (each response once, the paper's), token-mean, seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO)."""
    adv_scale: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: group std (the paper's), batch std, or none (Dr. GRPO)."""
    beta: float = 0.0
    """KL penalty coefficient against the initial policy (the paper uses 0)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """KL estimator for the --beta penalty, per sampled token with ρ = π_ref/π: k1 = -log ρ (its expected gradient is 0: no KL pressure at all), k2 = ½ (log ρ)² (gradient of KL(π‖π_ref)), k3 = ρ - 1 - log ρ (unbiased value ≥ 0; gradient of the reverse KL(π_ref‖π), as in GRPO)."""
    mask_truncated_completions: bool = False
    """Leave completions cut by --max-new-tokens out of the loss (they still count for the group's advantages), as TRL's mask_truncated_completions."""
    old_logp: Literal["auto", "recompute", "sampling"] = "auto"
    """Old-policy log-probs: recompute with a training forward pass before the updates, or reuse the sampling pass's (paper §5.4). auto: sampling when the policy itself samples in float32 (the two agree to 1e-5), else recompute."""

    sapo_tau_pos: float = 1.0
    """SAPO: gate temperature where the advantage is > 0 (its paper's 1.0)."""
    sapo_tau_neg: float = 1.05
    """SAPO: gate temperature where the advantage is < 0 (its paper's 1.05; >= --sapo-tau-pos damps negative updates faster)."""

    # --- sampler/trainer mismatch corrections (need --old-logp recompute) ------------------
    rollout_is: Literal["off", "token", "sequence", "geometric"] = "off"
    """Weight each token's loss by π_old/π_rollout (the trainer's recomputed over the sampler's log-probs): per token, per response (product), or per response with the geometric mean (length-normalised, GSPO's)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """truncate: weights capped at --rollout-is-high (TIS); mask: weights outside [--rollout-is-low, --rollout-is-high] drop the token or response, the others weigh 1 (IcePop, MIS)."""
    rollout_is_low: float = 0.5
    """Lower bound of the --rollout-is mask."""
    rollout_is_high: float = 2.0
    """Upper bound of the --rollout-is weights (truncation cap, or the mask's upper bound)."""
    opsm_delta: float | None = None
    """Off-policy sequence masking (DeepSeek-V3.2): drop responses with a negative advantage whose mean per-token log π_rollout/π_θ exceeds this (None: off)."""

    # --- Mixture-of-Experts and inference log-probs ---------------------------------------
    routing_replay: bool = False
    """MoE: record the experts each token used when the old log-probs were computed (while sampling, with --old-logp sampling) and force them when computing the current policy's log-probs for the ratio (Routing Replay)."""
    router_aux_loss_coef: float = 0.0
    """MoE: weight of the router load-balancing loss added to the policy loss (0 = off)."""
    rollout_dtype: Literal["same", "float32", "bfloat16", "float16"] = "same"
    """Sample with a copy of the policy in this dtype, synced every step, to emulate an inference engine's precision (same = sample with the policy itself)."""

    # --- rollout engine ------------------------------------------------------------------
    rollout_engine: Literal["hf", "vllm"] = "hf"
    """Who samples: hf (gspo's own sampler) or vllm (a colocated vLLM engine in this process, synced with the policy's weights before every rollout; install: see docs/vllm.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """vLLM on CUDA: the share of the GPU the engine may take (its weights and KV cache); the rest is the trainer's."""
    vllm_kv_cache_gib: float = 2.0
    """vLLM on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, unless set)."""
    vllm_max_model_len: int = 0
    """vLLM: the longest prompt + completion the engine accepts (0 = the model's max_position_embeddings)."""
    vllm_sleep: bool = True
    """vLLM on CUDA: put the engine to sleep (weights offloaded, KV cache freed) during the update phase."""

    # --- PPO: value model and GAE ---------------------------------------------------------
    critic: Literal["separate", "shared"] = "separate"
    """PPO value model: separate (a copy of the policy's trunk with a value head, its own optimizer) or shared (a value head on the policy's trunk)."""
    critic_lr: float | None = None
    """PPO: learning rate of the value model (the separate critic, or the shared value head) (None: 10 x lr)."""
    gamma: float = 1.0
    """PPO: GAE discount over completion tokens."""
    gae_lambda: float = 0.95
    """PPO: GAE lambda."""
    value_clip: float = 0.2
    """PPO: value-loss clip range around the old values (0 = no clipping)."""
    vf_coef: float = 0.5
    """PPO with --critic shared: weight of the value loss in the joint loss."""
    whiten_advantages: bool = True
    """PPO: normalise advantages to zero mean and unit variance over the batch's completion tokens."""
    reward_kl_coef: float = 0.0
    """PPO: per-token KL penalty to the frozen initial policy folded into the reward, as in RLHF PPO (0 = off)."""

    # --- optimiser -----------------------------------------------------------------------
    lr: float = 1e-4
    """AdamW learning rate (peak, after warm-up)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    max_grad_norm: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    lr_schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate schedule after warm-up, advanced once per training step."""
    warmup_steps: int = 5
    """Training steps of linear learning-rate warm-up from 0."""

    # --- model ---------------------------------------------------------------------------
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Compute dtype of the policy. bfloat16 / float16: mixed precision, float32 master weights and optimizer state with forwards under autocast (float16 adds loss scaling); the sampler is a copy in this dtype (under --parallel fsdp, the sharded policy itself, gathered in this dtype for each rollout). Log-softmax and the loss are always float32."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the trained weights and their optimizer state: float32 (mixed precision with --dtype), or the same as --dtype for pure low-precision training (bfloat16: half the memory, but updates smaller than a weight's resolution are lost)."""
    micro_batch_tokens: int = 0
    """Token budget of one forward/backward pass: updates, old-policy, reference and critic passes run in micro-batches of at most this many tokens (rows x padded length, or real tokens with --packing) and gradients accumulate to the same update; 0 = a whole minibatch per pass."""
    packing: bool = False
    """Pack each micro-batch's sequences into one row (no padding computed, positions restart per sequence, attention kept within each); padding is used where the model does not support it and for MoE models."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, more time."""
    lora_r: int = 0
    """LoRA rank (0 = train all weights). With LoRA only the adapters train and checkpoints hold only the adapter."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by lora_alpha / lora_r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input, written to the adapter's config; gspo runs every policy pass with dropout off (so on-policy ratios are exactly 1)."""
    lora_target_modules: tuple[str, ...] = ("all-linear",)
    """Modules that get adapters: all-linear, or names such as q_proj v_proj."""

    # --- evaluation ----------------------------------------------------------------------
    eval_size: int = 500
    """Held-out problems for greedy accuracy, before and after training (0 = no evaluation)."""
    eval_every: int = 0
    """Also evaluate every N steps (0 = only before and after)."""

    # --- run -----------------------------------------------------------------------------
    seed: int = 0
    """Seed for prompts, sampling and minibatch order; a run is deterministic on CPU for a seed."""
    output_dir: str | None = None
    """Run directory (None: runs/<algorithm>-<date>-<time>)."""
    save_every: int = 20
    """Checkpoint every N steps (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk (the newest)."""
    samples_per_step: int = 4
    """Completions per step written to samples.jsonl."""
    device: str = "cpu"
    """Device for the policy: cpu, cuda, cuda:N, or auto (cuda when available)."""
    threads: int = 0
    """CPU threads for torch (0 = torch's default)."""
    parallel: Literal["ddp", "fsdp"] = "ddp"
    """Under torchrun (several processes): ddp replicates the model, fsdp shards parameters, gradients and optimizer state (FSDP2)."""
    progress: bool = True
    """Show a progress bar."""
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = ()
    """Also log metrics to tensorboard (run_dir/tensorboard) and/or wandb; metrics.jsonl is always written."""
    wandb_project: str = "gspo"
    """Weights & Biases project (set WANDB_MODE=offline to log without a network)."""

    @classmethod
    def from_trl(cls, **options) -> TrainConfig:
        """A config from TRL's GRPOConfig names (num_generations=8, loss_type="dr_grpo") and gspo's (gspo.aliases)."""
        from gspo.aliases import from_trl

        return from_trl(**options)


AT_LEAST = {  # simple lower bounds: field -> smallest valid value
    "lora_r": 0, "steps": 0, "prompts_per_step": 1, "min_new_tokens": 0, "num_minibatches": 1, "epochs": 1,
    "beta": 0, "value_clip": 0, "vf_coef": 0, "reward_kl_coef": 0, "router_aux_loss_coef": 0,
    "weight_decay": 0, "max_grad_norm": 0, "warmup_steps": 0, "eval_every": 0, "save_every": 0,
    "keep_checkpoints": 1, "samples_per_step": 0, "threads": 0, "micro_batch_tokens": 0, "top_k": 0,
    "vllm_max_model_len": 0, "reward_model_batch_size": 1,
    "max_prompt_length": 0, "eval_size": 0, "max_episode_tokens": 0,
}
TURN_ADVANTAGE_LOSSES = ("gspo_token", "grpo", "cispo", "sapo")  # token-level: take (B, T) advantages


def validate(cfg: TrainConfig) -> None:
    """Raise ConfigError with a one-line message for the first bad value (its type, then its range)."""
    from gspo.tasks import TASKS

    from gspo.configfile import check_value

    for f in dataclasses.fields(TrainConfig):
        check_value(f.name, getattr(cfg, f.name), f.name)

    def need(ok: bool, name: str, msg: str):
        _need(cfg, ok, name, msg)

    for name, low in AT_LEAST.items():
        need(getattr(cfg, name) is None or getattr(cfg, name) >= low, name, f"must be >= {low}")
    need(cfg.algorithm in PRESETS, "algorithm", f"must be one of {', '.join(PRESETS)}")
    need(cfg.dataset is not None or cfg.task in TASKS, "task", f"must be one of {', '.join(TASKS)} (or give --dataset)")
    need(not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.reward), "reward_weights",
         f"needs one weight per --reward ({len(cfg.reward)} rewards)")
    need(cfg.lora_alpha > 0, "lora_alpha", "must be > 0")
    need(0 <= cfg.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
    need(len(cfg.lora_target_modules) >= 1, "lora_target_modules", "needs at least one module name")
    need(cfg.device == "auto" or cfg.device.split(":")[0] in ("cpu", "cuda", "mps"), "device",
         "must be cpu, cuda, cuda:N, mps or auto")
    if cfg.algorithm == "ppo":
        need(cfg.group_size >= 1, "group_size", "must be >= 1")
    else:
        need(cfg.group_size >= 2, "group_size", "must be >= 2 (advantages are relative to the group)")
    need(cfg.max_new_tokens is None or cfg.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
    need(cfg.max_new_tokens is None or cfg.min_new_tokens <= cfg.max_new_tokens, "min_new_tokens",
         "must be <= max_new_tokens")
    need(cfg.temperature > 0, "temperature", "must be > 0 for sampling")
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    batch = cfg.prompts_per_step * cfg.group_size
    need(batch % cfg.num_minibatches == 0, "num_minibatches",
         f"must divide the rollout batch prompts_per_step * group_size = {batch}")
    for name in ("clip_low", "clip_high"):
        v = getattr(cfg, name)
        need(v is None or v >= 0, name, "must be >= 0")
    need(cfg.clip_low is None or cfg.clip_low <= 1 or cfg.algorithm in LOG_SPACE_CLIP, "clip_low",
         "must be <= 1 (the ratio is clipped at 1 - clip_low >= 0)")
    need(cfg.loss_agg in AGG_MODES, "loss_agg", f"must be one of {', '.join(AGG_MODES)}")
    _validate_combinations(cfg)


def _need(cfg: TrainConfig, ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{name}: {msg} (got {getattr(cfg, name)!r})")


def _validate_combinations(cfg: TrainConfig) -> None:
    """validate, continued: the remaining ranges, and options that do not go together."""

    def need(ok: bool, name: str, msg: str):
        _need(cfg, ok, name, msg)

    need(cfg.lr > 0, "lr", "must be > 0")
    need(cfg.critic_lr is None or cfg.critic_lr > 0, "critic_lr", "must be > 0")
    need(0 <= cfg.gamma <= 1, "gamma", "must be in [0, 1]")
    need(0 <= cfg.gae_lambda <= 1, "gae_lambda", "must be in [0, 1]")
    need(not (cfg.routing_replay and cfg.gradient_checkpointing), "routing_replay",
         "cannot be combined with --gradient-checkpointing (the recomputed forward would route freely)")
    need(not (cfg.parallel == "fsdp" and cfg.rollout_dtype not in ("same", cfg.dtype)), "parallel",
         f"fsdp samples with the sharded policy itself, in --dtype {cfg.dtype}: a --rollout-dtype of "
         f"{cfg.rollout_dtype} would need a second full copy of the weights on every process; drop --rollout-dtype "
         f"(or set --dtype {cfg.rollout_dtype}), or use --parallel ddp")
    need(cfg.param_dtype in ("float32", cfg.dtype), "param_dtype",
         f"must be float32 (mixed precision) or the compute --dtype {cfg.dtype} (pure low precision)")
    need(cfg.param_dtype != "float16", "param_dtype",
         "float16 weights cannot be trained directly (Adam's eps 1e-8 rounds to 0 and every weight turns NaN); "
         "use the default float32 master weights with --dtype float16")
    need(not (cfg.dtype == "float16" and cfg.parallel == "fsdp"), "dtype",
         "float16 (loss scaling) is not supported with --parallel fsdp; use bfloat16")
    vllm = cfg.rollout_engine == "vllm"
    need(not (vllm and cfg.routing_replay), "routing_replay",
         "cannot be combined with --rollout-engine vllm: this vLLM cannot return the experts it routed each token "
         "to (R3 needs its Model Runner V2); use --rollout-engine hf")
    need(not (vllm and cfg.old_logp == "sampling" and (cfg.top_p < 1 or cfg.top_k > 0 or cfg.min_new_tokens > 0)),
         "old_logp", "sampling with --rollout-engine vllm needs --top-p 1, --top-k 0 and --min-new-tokens 0: vLLM "
         "renormalises its log-probs over the tokens top-p/top-k keep and without the stop tokens it bans, which are "
         "then not the policy's (use --old-logp recompute or auto)")
    need(cfg.sapo_tau_pos > 0 and cfg.sapo_tau_neg > 0, "sapo_tau_pos" if cfg.sapo_tau_pos <= 0 else "sapo_tau_neg",
         "must be > 0")
    need(0 <= cfg.rollout_is_low <= 1, "rollout_is_low", "must be in [0, 1]")
    need(cfg.rollout_is_high >= 1, "rollout_is_high", "must be >= 1")
    need(cfg.opsm_delta is None or cfg.opsm_delta >= 0, "opsm_delta", "must be >= 0")
    need(not (corrects_mismatch(cfg) and cfg.old_logp == "sampling"), "old_logp",
         "sampling cannot be combined with --rollout-is or --opsm-delta: the corrections compare the sampler's "
         "log-probs with the trainer's recomputed ones (use --old-logp recompute or auto)")
    need(cfg.max_turns is None or cfg.max_turns >= 1, "max_turns", "must be >= 1")
    need(not cfg.turn_advantages or cfg.algorithm in TURN_ADVANTAGE_LOSSES, "turn_advantages",
         f"needs a token-level loss ({', '.join(TURN_ADVANTAGE_LOSSES)}), not --algorithm {cfg.algorithm}: "
         f"a sequence ratio takes one advantage per episode")
    need(0 < cfg.vllm_gpu_memory_utilization < 1, "vllm_gpu_memory_utilization", "must be in (0, 1)")
    need(cfg.vllm_kv_cache_gib > 0, "vllm_kv_cache_gib", "must be > 0")


def corrects_mismatch(cfg: TrainConfig) -> bool:
    """A sampler/trainer mismatch correction is on: it needs both log-probs, the sampler's and
    the trainer's recomputed ones."""
    return cfg.rollout_is != "off" or cfg.opsm_delta is not None


def resolve(cfg: TrainConfig) -> TrainConfig:
    """Validate, then fill the derived fields: the clip range from the preset, the run directory."""
    from gspo.configfile import check_value

    cfg = dataclasses.replace(cfg, **{f.name: check_value(f.name, getattr(cfg, f.name), f.name)
                                      for f in dataclasses.fields(TrainConfig)})  # lists -> tuples, ints -> floats
    validate(cfg)
    out = dataclasses.replace(cfg)
    for key, value in PRESETS[cfg.algorithm].items():
        if getattr(out, key) is None:
            setattr(out, key, value)
    if out.old_logp == "auto":  # in fp32 the sampling pass's log-probs are the recomputation's, to 1e-5
        same_precision = out.dtype == "float32" and out.rollout_dtype in ("same", "float32")
        # vLLM renormalises its log-probs over the tokens top-p/top-k keep, and over the non-stop
        # tokens for the first min_new_tokens (it bans them first): not the policy's distribution
        full_distribution = out.rollout_engine == "hf" or (out.top_p == 1.0 and out.top_k == 0
                                                           and out.min_new_tokens == 0)
        out.old_logp = "sampling" if same_precision and full_distribution and not corrects_mismatch(out) else "recompute"
    if out.model is None or out.steps is None:  # the task's own (calculator: a chat model that calls tools)
        from gspo.tasks import TASKS, get_task

        task = get_task(out.task) if out.dataset is None and out.task in TASKS else None
        out.model = out.model or getattr(task, "default_model", "tiny")
        out.steps = getattr(task, "default_steps", 60) if out.steps is None else out.steps
    if out.critic_lr is None:
        out.critic_lr = 10 * out.lr
    if out.max_new_tokens is None:
        from gspo.data import DatasetTask
        from gspo.tasks import get_task

        out.max_new_tokens = DatasetTask.default_max_new_tokens if out.dataset else get_task(out.task).default_max_new_tokens
    if out.min_new_tokens > out.max_new_tokens:  # the task's default max_new_tokens is known only now
        raise ConfigError(f"min_new_tokens: must be <= max_new_tokens, {out.max_new_tokens} (the "
                          f"{'task' if cfg.max_new_tokens is None else 'given'} value) (got {out.min_new_tokens})")
    if out.output_dir is None:
        out.output_dir = str(Path("runs") / f"{out.algorithm}-{time.strftime('%Y%m%d-%H%M%S')}")
    return out


def to_dict(cfg: TrainConfig) -> dict:
    """Plain YAML/JSON-able values (tuples become lists)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(cfg).items()}


