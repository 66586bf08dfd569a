"""The sections of a training configuration: every option with its default, help and bounds.

Each option is written once, with everything known about it:

    group_size: int = opt(8, "Completions sampled per prompt (G) ...", ge=1)
    steps: int | None = opt(None, "Training steps ...", ge=0, resume=True)

its type (checked strictly by gspo.config.checks, wherever a value comes from), its default, its help
(what `gspo train --help`, tyro and docs/options.md show), its bounds (`ge`, `gt`, `le`, `lt`:
checked by the same check, with one message per kind of bound) and whether `--resume` may change
it. Rules between options (min_new_tokens <= max_new_tokens, fsdp with a second sampler
dtype ...) are gspo.train.resolve's. A section is handed whole to the code it configures
(`load_policy(cfg.policy, cfg.lora, ...)`). gspo.config.TrainConfig is made of these sections.
This module imports nothing from gspo.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the field."""


def opt(default, help: str, *, resume: bool = False, **bounds):
    """An option of a section: its default, help text, whether --resume may change it, and its
    bounds (`ge`, `gt`, `le`, `lt`: >=, >, <=, < a number)."""
    if unknown := set(bounds) - {"ge", "gt", "le", "lt"}:
        raise TypeError(f"opt: unknown bounds {sorted(unknown)}")
    return dataclasses.field(default=default, metadata={"help": help, "bounds": bounds, "resume": resume})


def bounds_error(bounds: dict, value) -> str | None:
    """'must be >= 1', 'must be in (0, 1]' ... when `value` is outside `bounds`, else None (None passes)."""
    if value is None or not bounds:
        return None
    ok = all((k != "ge" or value >= b) and (k != "gt" or value > b) and (k != "le" or value <= b)
             and (k != "lt" or value < b) for k, b in bounds.items())
    if ok:
        return None
    low, high = bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt"))
    if high is None:
        return f"must be {'>=' if 'ge' in bounds else '>'} {low}"
    return f"must be in {'[' if 'ge' in bounds else '('}{low}, {high}{']' if 'le' in bounds else ')'}"


@dataclass
class Policy:
    """The policy: which model, its precision, and how its forward and backward passes run."""

    model: str | None = opt(None,
        "Default: the task's model (tiny-long for chain, tiny-tool for calculator), else tiny. A Hugging Face "
        "Hub id (Qwen/Qwen2.5-0.5B-Instruct: downloaded, or read from the local cache offline), the path of a "
        "local Hugging Face causal LM directory, a .gguf file (or a directory holding one: dequantised once, "
        "cached; needs pip install 'gspo[gguf]'), or a built-in model name (tiny, a dense Qwen3; tiny-moe, a "
        "Qwen3-MoE, 8 experts, top-2; tiny-moe-wide, 32 experts, top-8; "
        "tiny-long and tiny-long-moe, the same for the chain task; tiny-tool, a chat model that "
        "calls tools, for the calculator task).")
    revision: str | None = opt(None,
        "Hub revision of --model (a branch, tag or commit hash; None: main); also used for the reference "
        "model and PPO's critic.")
    dtype: Literal["float32", "bfloat16", "float16"] = opt("float32",
        "Compute dtype of the policy. bfloat16 / float16: mixed precision, float32 master weights and "
        "optimizer state with forwards under autocast (float16 adds loss scaling); the sampler is a copy in "
        "this dtype (under --parallel fsdp, the sharded policy itself, gathered in this dtype for each "
        "rollout). Log-softmax and the loss are always float32.")
    param_dtype: Literal["float32", "bfloat16", "float16"] = opt("float32",
        "Dtype of the trained weights and their optimizer state: float32 (mixed precision with --dtype), or "
        "the same as --dtype for pure low-precision training (bfloat16: half the memory, but updates smaller "
        "than a weight's resolution are lost).")
    micro_batch_tokens: int = opt(0,
        "Token budget of one forward/backward pass: updates, old-policy, reference and critic passes run in "
        "micro-batches of at most this many tokens (rows x padded length, or real tokens with --packing) and "
        "gradients accumulate to the same update; 0 = a whole minibatch per pass.", ge=0)
    packing: bool = opt(False,
        "Pack each micro-batch's sequences into one row (no padding computed, positions restart per sequence, "
        "attention kept within each); padding is used where the model does not support it and for MoE models.")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass: less memory, more time.")


@dataclass
class LoRA:
    """Low-rank adapters: train them instead of every weight."""

    lora_r: int = opt(0,
        "LoRA rank (0 = train all weights). With LoRA only the adapters train and checkpoints hold only the "
        "adapter.", ge=0)
    lora_alpha: float = opt(16.0, "LoRA scaling numerator (the update is scaled by lora_alpha / lora_r).", gt=0)
    lora_dropout: float = opt(0.0,
        "Dropout on the LoRA input, written to the adapter's config; gspo runs every policy pass with dropout "
        "off (so on-policy ratios are exactly 1).", ge=0, lt=1)
    lora_target_modules: tuple[str, ...] = opt(("all-linear",),
        "Modules that get adapters: all-linear, or names such as q_proj v_proj.")


@dataclass
class Data:
    """The prompts: a built-in task or a dataset, and how its rows become prompts."""

    task: str = opt("arithmetic",
        "Built-in task: arithmetic (sums and differences of 3-digit numbers), addition, chain (long answers: "
        "count up from a in steps of d to 1000, every step written out, 55-217 tokens; its model, tiny-long, "
        "is the default; tiny-long-moe is its MoE twin), or calculator (multi-turn: two-digit products with a "
        "calculator tool; its model, tiny-tool, is the default); or reasoning_gym:NAME, one of reasoning-gym's "
        "generators (a mix: reasoning_gym:a=2,b=1; `gspo tasks` lists them; needs --model); or verifiers:TASKSET_ID, "
        "an installed verifiers environment, its tasks, agent program and rewards (docs/agents.md; needs --model). "
        "Ignored with --dataset.")
    answer_from: Literal["tag", "tag_only", "last_line", "last_number"] = opt("tag",
        "What a reasoning_gym task's verifier scores: tag, the text inside the last <answer>...</answer> "
        "(reasoning-gym's convention; the default system prompt asks for it), else the reply's last non-empty "
        "line; tag_only, the tags or nothing (scored 0); last_line; last_number, the reply's last number (for "
        "small models that never write the tags).")
    task_options: tuple[str, ...] = opt((),
        "Options of a reasoning_gym task's generator, KEY=VALUE (values read as YAML scalars: 3, true, [1, 2]); "
        "repeat --task-option KEY=VALUE. In a mix, NAME.KEY=VALUE sets one generator's. YAML and Python also "
        "take a mapping. `gspo tasks reasoning_gym:NAME` shows a generator's options. For a verifiers task: its "
        "taskset config's fields, and harness=ID / runtime=TYPE (default null and subprocess).")
    dataset: str | None = opt(None,
        "Training data: a Hugging Face Hub dataset id (openai/gsm8k: downloaded, or read from the local cache "
        "offline), a .jsonl, .json, .csv, .tsv or .parquet file, or a datasets directory (save_to_disk or "
        "data files). None: the built-in --task.")
    dataset_config: str | None = opt(None,
        "Configuration (subset) of a Hub dataset, e.g. main for openai/gsm8k (None: its default).")
    dataset_split: str = opt("train", "Split to train on, for a dataset directory with several splits.")
    eval_dataset: str | None = opt(None,
        "Evaluation data (same formats). None: --eval-split if given, else a fixed held-out slice of "
        "--dataset.")
    eval_split: str | None = opt(None, "Split to evaluate on, for a dataset directory with several splits (e.g. test).")
    prompt_column: str = opt("prompt",
        "Dataset column holding the prompt: a string, or a list of chat messages (gets the chat template).")
    answer_column: str = opt("answer",
        "Dataset column holding the reference answer (string or number) that rewards compare to; passed to "
        "rewards as `answer`.")
    system_prompt: str | None = opt(None,
        "A system message: string prompts become chat messages (this system turn, then the prompt as the "
        "user's turn) and get the chat template; prompts that are already chat messages get it as their first "
        "turn unless they have one.")
    max_prompt_length: int = opt(0,
        "Longest prompt, in tokens (after the chat template): longer prompts keep their last "
        "max_prompt_length tokens (as TRL truncates), and a warning counts them; 0 = no limit.", ge=0)


@dataclass
class Rewards:
    """How completions are scored."""

    reward: tuple[str, ...] = opt((),
        "Rewards: built-in names (exact_match, exact_integer, numeric_match, math_verify, format, length; "
        "reasoning_gym and answer_format for reasoning_gym tasks), "
        "module:function / file.py:function, a learned reward model (an AutoModelForSequenceClassification "
        "directory or Hub id, scored on prompt + completion with its own tokenizer and chat template), or a judge, "
        "judge:MODEL_OR_URL (a language model's verdict in [0, 1]: a --model form, or an OpenAI-compatible "
        "server's http://HOST:PORT; docs/judges.md). Empty: "
        "the task's default (exact_integer for the built-in tasks, exact_match for a dataset). The first "
        "reward is the accuracy reported by evaluation.")
    reward_weights: tuple[float, ...] = opt((),
        "One weight per --reward; the training reward is their weighted sum (empty: all 1).")
    format_pattern: str = opt(r"<think>.*?</think>\s*<answer>.*?</answer>",
        "Regular expression the whole completion must match for the `format` reward.")
    reward_model_device: str | None = opt(None,
        "Device of learned reward models (a --reward naming an AutoModelForSequenceClassification) and judge "
        "models (judge:MODEL): cpu, cuda, cuda:N (None: the policy's device).", resume=True)
    reward_model_batch_size: int = opt(32,
        "Completions a learned reward model scores, or a judge model judges, per forward pass.", ge=1, resume=True)
    judge_template: str = opt("correctness",
        "A judge's prompt (--reward judge:...): correctness (the completion against the example's answer, "
        "answered VERDICT: CORRECT/INCORRECT), rubric (against --judge-rubric, answered Score: X/10), or a "
        "str.format file with {prompt}, {completion}, {answer}, {rubric}.")
    judge_rubric: str | None = opt(None,
        "The rubric a judge grades by (text, or a file): the {rubric} of --judge-template rubric or your own.")
    judge_max_new_tokens: int = opt(64,
        "The longest verdict a judge writes, in tokens.", ge=1, resume=True)
    judge_timeout: float = opt(60.0,
        "Seconds a judge server has to answer one request; past it the run stops with one line.", gt=0,
        resume=True)


@dataclass
class Loss:
    """The policy loss and its update: clip ranges, aggregation, advantages, KL, the old policy."""

    algorithm: str = opt("gspo",
        "Policy loss, by its registered name: gspo (sequence ratio, paper Eq. 5) or another of the losses "
        "`gspo train --help` lists with their summaries and presets (gspo.algo.losses.LOSSES). Sets the preset "
        "clip range.")
    num_minibatches: int = opt(4,
        "Minibatches per rollout batch; the paper uses 4, so all but the first update are off-policy.", ge=1)
    epochs: int = opt(1, "Passes over the rollout batch.", ge=1)
    clip_low: float | None = opt(None,
        "Ratio clipped below at 1 - clip_low (None: the algorithm's preset; `gspo train --help` lists them).", ge=0)
    clip_high: float | None = opt(None,
        "Ratio clipped above at 1 + clip_high (None: the algorithm's preset; `gspo train --help` lists them).", ge=0)
    target_clip_frac: float | None = opt(None,
        "Hold the clip fraction near this by adapting the clip range between steps (gspo.algo.clipcontrol: "
        "both bounds scaled by exp(0.5 * relative error) after each step, within 100x of the start; logged as "
        "clip/eps_low, clip/eps_high). None: the range stays fixed.", gt=0, lt=1)
    loss_agg: str = opt("seq-mean-token-mean",
        "Loss aggregation: seq-mean-token-mean (each response once, the paper's), token-mean, "
        "seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO).")
    adv_scale: Literal["group", "batch", "none"] = opt("group",
        "Advantage scaling: group std (the paper's), batch std, or none (Dr. GRPO).")
    beta: float = opt(0.0, "KL penalty coefficient against the initial policy (the paper uses 0).", ge=0)
    kl_estimator: Literal["k1", "k2", "k3"] = opt("k3",
        "KL estimator for the --beta penalty, per sampled token with ρ = π_ref/π: k1 = -log ρ (its expected "
        "gradient is 0: no KL pressure at all), k2 = ½ (log ρ)² (gradient of KL(π‖π_ref)), k3 = ρ - 1 - log ρ "
        "(unbiased value ≥ 0; gradient of the reverse KL(π_ref‖π), as in GRPO).")
    old_logp: Literal["auto", "recompute", "sampling"] = opt("auto",
        "Old-policy log-probs: recompute with a training forward pass before the updates, or reuse the "
        "sampling pass's (paper §5.4). auto: sampling when the policy itself samples in float32 (the two "
        "agree to 1e-5), else recompute. Under --max-staleness: recompute is the proximal anchor (the weights "
        "that train the batch), sampling the behaviour one (the weights that sampled it); auto: recompute.")
    mask_truncated_completions: bool = opt(False,
        "Leave completions cut by --max-new-tokens out of the loss (they still count for the group's "
        "advantages), as TRL's mask_truncated_completions.")
    sapo_tau_pos: float = opt(1.0, "SAPO: gate temperature where the advantage is > 0 (its paper's 1.0).", gt=0)
    sapo_tau_neg: float = opt(1.05,
        "SAPO: gate temperature where the advantage is < 0 (its paper's 1.05; >= --sapo-tau-pos damps "
        "negative updates faster).", gt=0)
    ctpo_power: float = opt(0.5,
        "CTPO: its log-space clip band at token t is [-clip_low, clip_high] * t^power (its paper's 0.5: the prefix "
        "log-ratio's random walk; 0: a fixed band).", ge=0)
    ctpo_dual_clip: float | None = opt(0.05,
        "CTPO: where the advantage is < 0 the loss is capped at -A * exp(c * t^power) (dual clip; its paper's 0.05; "
        "None: off).", gt=0)
    cppo_w_min: float = opt(0.8,
        "CPPO: the budget weight of a response's last token (the first's is 1, linear between; its paper's 0.8).",
        gt=0, le=1)
    cppo_budget: float = opt(0.02,
        "CPPO: the floor of each response's prefix budget rate, δ_b = clamp(0.9-quantile of its |π - π_old|, "
        "budget, 2 budget) (its paper's 0.02).", gt=0)


@dataclass
class Corrections:
    """Importance weights and masks for the sampler/trainer mismatch (need the trainer's recomputed log-probs)."""

    rollout_is: Literal["off", "token", "sequence", "geometric"] = opt("off",
        "Weight each token's loss by π_old/π_rollout (the trainer's recomputed over the sampler's log-probs): "
        "per token, per response (product), or per response with the geometric mean (length-normalised, "
        "GSPO's).")
    rollout_is_mode: Literal["truncate", "mask"] = opt("truncate",
        "truncate: weights capped at --rollout-is-high (TIS); mask: weights outside [--rollout-is-low, "
        "--rollout-is-high] drop the token or response, the others weigh 1 (IcePop, MIS).")
    rollout_is_low: float = opt(0.5, "Lower bound of the --rollout-is mask.", ge=0, le=1)
    rollout_is_high: float = opt(2.0,
        "Upper bound of the --rollout-is weights (truncation cap, or the mask's upper bound).", ge=1)
    opsm_delta: float | None = opt(None,
        "Off-policy sequence masking (DeepSeek-V3.2): drop responses with a negative advantage whose mean "
        "per-token log π_rollout/π_θ exceeds this (None: off).", ge=0)


@dataclass
class PPO:
    """PPO's learned value model and GAE."""

    critic: Literal["separate", "shared"] = opt("separate",
        "PPO value model: separate (a copy of the policy's trunk with a value head, its own optimizer) or "
        "shared (a value head on the policy's trunk).")
    critic_lr: float | None = opt(None,
        "PPO: learning rate of the value model (the separate critic, or the shared value head) (None: 10 x "
        "lr).", gt=0)
    gamma: float = opt(1.0, "PPO: GAE discount over completion tokens.", ge=0, le=1)
    gae_lambda: float = opt(0.95, "PPO: GAE lambda.", ge=0, le=1)
    value_clip: float = opt(0.2, "PPO: value-loss clip range around the old values (0 = no clipping).", ge=0)
    vf_coef: float = opt(0.5, "PPO with --critic shared: weight of the value loss in the joint loss.", ge=0)
    whiten_advantages: bool = opt(True,
        "PPO: normalise advantages to zero mean and unit variance over the batch's completion tokens.")
    reward_kl_coef: float = opt(0.0,
        "PPO: per-token KL penalty to the frozen initial policy folded into the reward, as in RLHF PPO (0 = "
        "off).", ge=0)


@dataclass
class Sampling:
    """The rollout: how many completions, how long, drawn how and by whom."""

    prompts_per_step: int = opt(32, "Distinct prompts sampled per step.", ge=1)
    group_size: int = opt(8, "Completions sampled per prompt (G); advantages are relative to the group.", ge=1)
    max_new_tokens: int | None = opt(None,
        "Longest completion, in tokens; longer ones are cut and marked truncated (None: the task's default, 8 "
        "for arithmetic, 256 for a dataset).", ge=1)
    min_new_tokens: int = opt(0,
        "EOS cannot be sampled before this many tokens (min = max fixes every completion's length, for "
        "benchmarks).", ge=0)
    temperature: float = opt(1.0,
        "Sampling temperature; the same temperature scales the logits of training log-probs.", gt=0)
    top_p: float = opt(1.0, "Nucleus sampling mass (1.0 = off).", gt=0, le=1)
    top_k: int = opt(0,
        "Sample only among the k most likely tokens (0 = off). Like top-p it limits what can be drawn; "
        "log-probs stay those of the full distribution.", ge=0)
    stop_token: tuple[str, ...] = opt((),
        "More tokens that end a completion (e.g. <|im_end|>); the tokenizer's EOS and the model's "
        "generation_config.eos_token_id always do.")
    stop_string: tuple[str, ...] = opt((),
        "Strings that end a completion (e.g. \"</answer>\"): it is cut after the token that completes the first "
        "one (the sampler may run past it; those tokens are dropped).")
    rollout_engine: Literal["hf", "vllm", "vllm-server"] = opt("hf",
        "Who samples: hf (gspo's own sampler), vllm (a colocated vLLM engine in this process, synced with "
        "the policy's weights before every rollout; install: see docs/vllm.md) or vllm-server (vLLM's own "
        "server, --vllm-server-url, or one gspo starts here; synced through vLLM's weight API: docs/server.md).")
    rollout_dtype: Literal["same", "float32", "bfloat16", "float16"] = opt("same",
        "Sample with a copy of the policy in this dtype, synced every step, to emulate an inference engine's "
        "precision (same = sample with the policy itself).")
    cuda_graphs: bool = opt(True,
        "gspo's own sampler on a CUDA device: capture the decode step in a CUDA graph (a static KV cache, the "
        "batch padded to a bucket; once per rollout, checked against the eager step) where the model allows it "
        "(not an MoE model); false: every decode step launched eagerly. No effect on the CPU or with vLLM.",
        resume=True)
    integrity: Literal["stop", "warn"] = opt("stop",
        "What a breach of the integrity check does (a trained token that no sampler drew in that context, or "
        "an on-policy log-ratio past its tolerance; docs/agents.md, Integrity): stop the run before the step's "
        "update, or warn in one line and train on.", resume=True)


@dataclass
class VLLM:
    """vLLM: the colocated engine (--rollout-engine vllm) and its servers (--rollout-engine vllm-server)."""

    vllm_gpu_memory_utilization: float = opt(0.3,
        "vLLM on CUDA: the share of the GPU the engine may take (its weights and KV cache); the rest is the "
        "trainer's.", gt=0, lt=1, resume=True)
    vllm_kv_cache_gib: float = opt(2.0,
        "vLLM on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE, unless set).", gt=0, resume=True)
    vllm_max_model_len: int = opt(0,
        "vLLM: the longest prompt + completion the engine accepts (0 = the model's max_position_embeddings).", ge=0)
    vllm_sleep: bool = opt(True,
        "vLLM on CUDA: put the engine to sleep (weights offloaded, KV cache freed) during the update phase.",
        resume=True)
    vllm_server_url: tuple[str, ...] = opt((),
        "vllm-server: a running vLLM server to sample on, http://HOST:PORT (repeat for several: prompts are spread "
        "over them; more may be added at --resume). Its API key: the VLLM_API_KEY variable. None given: gspo "
        "starts one on this machine (127.0.0.1) and stops it at the end.", resume=True)
    vllm_server_timeout: float = opt(300.0,
        "vllm-server: seconds one request (a prompt's group of completions, or a health check) may take before "
        "the run stops with one line naming the server.", gt=0, resume=True)
    vllm_server_sync_timeout: float = opt(300.0,
        "vllm-server: seconds one weight sync (every server) may take before the run stops with one line.",
        gt=0, resume=True)
    vllm_server_start_timeout: float = opt(600.0,
        "vllm-server: seconds a server gspo starts has to answer its health check.", gt=0, resume=True)
    vllm_server_sync: Literal["auto", "directory", "nccl"] = opt("auto",
        "vllm-server: how the weights reach the servers: directory (safetensors shards the servers reload through "
        "vLLM's reload_weights: CPU, one machine or a shared filesystem), nccl (vLLM's NCCL weight transfer: "
        "GPUs, other nodes) or auto (nccl when the trainer is on CUDA, else directory).", resume=True)
    vllm_server_weights_dir: str | None = opt(None,
        "vllm-server with directory sync: where the weights are written for the servers to read (default: a "
        "temporary directory of the run's, removed at its end; across machines, a shared filesystem path).",
        resume=True)
    vllm_check_weight_sync: bool = opt(True,
        "vllm-server: after every sync, each server's log-probs of a fixed prompt are compared with the "
        "trainer's forward; a gap past the dtype's bound stops the run.", resume=True)


@dataclass
class Episodes:
    """Multi-turn episodes with an environment."""

    env: str | None = opt(None,
        "Environment for multi-turn episodes (docs/multiturn.md): path/to/file.py:ClassName or "
        "package.module:ClassName. Default: the task's own (calculator: its calculator tool), else "
        "single-turn.")
    max_turns: int | None = opt(None,
        "Model turns per episode at most (None: the task's default, 3 for calculator; 1 without an "
        "environment).", ge=1)
    max_episode_tokens: int = opt(0,
        "Token budget of an episode after the prompt, model and environment tokens together (0 = what the "
        "model's positions leave after the longest prompt); an episode that reaches it ends, flagged "
        "truncated.", ge=0)
    episode_timeout: float = opt(300.0,
        "Agents (--env naming an async rollout function, docs/agents.md): seconds an episode may run; one that "
        "runs longer fails (reward 0, not trained). 0 = no limit.", ge=0)
    turn_advantages: bool = opt(False,
        "Per-turn advantages: each model turn's tokens get the group-normalised reward from that turn on (the "
        "environment's turn rewards from there plus the final reward), for token-level losses (gspo_token, "
        "grpo, cispo, sapo); off: one advantage per episode.")


@dataclass
class AsyncRL:
    """Asynchronous RL: rollouts sampled by older weights, by rollout workers in processes of their own."""

    max_staleness: int = opt(0,
        "Policy versions (steps) a batch's sampling weights may lag the weights it trains (K): batch t is "
        "sampled by version max(0, t-1-K), while versions t-K .. t-1 train (0 = synchronous). docs/async.md.",
        ge=0)
    rollout_workers: int = opt(0,
        "Sampler processes of their own (0 = the trainer's process samples, K versions late): each gets the "
        "new weights after every step, one tensor at a time, and samples and scores whole batches. Under "
        "torchrun: the world's last N ranks. A resumed run may change it (the batches are the same).", ge=0,
        resume=True)
    rollout_devices: tuple[str, ...] = opt((),
        "The device of each rollout worker (cpu, cuda:N; N per trainer process, or N x processes in rank order); "
        "default: the trainer's --device (under torchrun: each rollout rank's own).", resume=True)
    partial_rollouts: bool = opt(False,
        "--rollout-engine vllm-server with --max-staleness >= 1: a weight sync aborts the generations under way and "
        "each continues under the new weights from where it stopped (partial rollouts), instead of the sync waiting "
        "for them; every token records the version that sampled it. docs/server.md.", resume=True)
    drop_uniform_groups: bool = opt(False,
        "Replace groups whose rewards are all equal (no signal) by groups with signal from fresh prompts "
        "(DAPO's dynamic sampling); what is still uniform after --resample-rounds is left out of the loss.")
    resample_rounds: int = opt(2, "--drop-uniform-groups: further sampling rounds at most per batch.", ge=0)


@dataclass
class MoE:
    """Mixture-of-Experts models: Routing Replay and the load-balancing loss."""

    routing_replay: bool = opt(False,
        "MoE: record the experts each token used when the old log-probs were computed (while sampling, with "
        "--old-logp sampling) and force them when computing the current policy's log-probs for the ratio "
        "(Routing Replay).")
    router_aux_loss_coef: float = opt(0.0,
        "MoE: weight of the router load-balancing loss added to the policy loss (0 = off).", ge=0)


@dataclass
class Distill:
    """On-policy distillation: a frozen teacher scores the student's own tokens (docs/distill.md)."""

    teacher: tuple[str, ...] = opt((),
        "Teacher for on-policy distillation: a model (built-in name, directory, gspo checkpoint, Hub id, .gguf), "
        "an OpenAI-compatible server's URL that returns prompt log-probs (vLLM), or `self` (the policy frozen at the "
        "step, with --teacher-context); NAME=TEACHER gives a reasoning-gym mix's task NAME its own teacher. It "
        "scores the student's sampled tokens in the student's context; its tokenizer must be the student's.")
    teacher_url: str | None = opt(None,
        "The teacher served at this URL (shorthand for --teacher URL): an OpenAI-compatible server returning "
        "prompt log-probs, such as `vllm serve`.")
    distill_coef: float = opt(1.0,
        "λ: each completion token's advantage gains λ·(log π_teacher − log π_student) (the negative reverse KL, "
        "detached, discount 0), added to the reward's group advantages (--reward none: distillation alone).", gt=0)
    teacher_context: str | None = opt(None,
        "Privileged context the teacher sees and the student does not: a template of the example's fields "
        "({answer}, or a dataset column), appended to the prompt's last message (`self` needs it).")
    teacher_dtype: Literal["same", "float32", "bfloat16", "float16"] = opt("same",
        "A local teacher's dtype: same (the trainer's compute --dtype) or a low-precision copy.")


@dataclass
class Optim:
    """AdamW and its learning-rate schedule."""

    lr: float = opt(1e-4, "AdamW learning rate (peak, after warm-up).", gt=0)
    weight_decay: float = opt(0.0, "AdamW weight decay.", ge=0)
    adam_betas: tuple[float, float] = opt((0.9, 0.999), "AdamW betas.")
    max_grad_norm: float = opt(1.0, "Gradient clipping by global norm (0 = off).", ge=0)
    lr_schedule: Literal["constant", "cosine", "linear"] = opt("constant",
        "Learning-rate schedule after warm-up, advanced once per training step.")
    warmup_steps: int = opt(5, "Training steps of linear learning-rate warm-up from 0.", ge=0)


@dataclass
class Eval:
    """Greedy accuracy on held-out problems."""

    eval_size: int = opt(500,
        "Held-out problems for greedy accuracy, before and after training (0 = no evaluation).", ge=0)
    eval_every: int = opt(0, "Also evaluate every N steps (0 = only before and after).", ge=0, resume=True)


@dataclass
class RunOptions:
    """The run: its length and seed, where it writes, how it logs, where it computes."""

    steps: int | None = opt(None,
        "Training steps; each step is one rollout batch and all the updates it feeds (None: the task's "
        "default, 60; 20 for calculator).", ge=0, resume=True)
    seed: int = opt(0, "Seed for prompts, sampling and minibatch order; a run is deterministic on CPU for a seed.")
    output_dir: str | None = opt(None, "Run directory (None: runs/<algorithm>-<date>-<time>).")
    save_every: int = opt(20,
        "Checkpoint every N steps (and always at the end); 0 = only at the end.", ge=0, resume=True)
    keep_checkpoints: int = opt(2, "Checkpoints kept on disk (the newest).", ge=1, resume=True)
    samples_per_step: int = opt(4, "Completions per step written to samples.jsonl.", ge=0, resume=True)
    progress: bool = opt(True, "Show a progress bar.", resume=True)
    report_to: tuple[Literal["tensorboard", "wandb"], ...] = opt((),
        "Also log metrics to tensorboard (run_dir/tensorboard) and/or wandb; metrics.jsonl is always written.",
        resume=True)
    wandb_project: str = opt("gspo",
        "Weights & Biases project (set WANDB_MODE=offline to log without a network).", resume=True)
    device: str = opt("cpu", "Device for the policy: cpu, cuda, cuda:N, or auto (cuda when available).", resume=True)
    threads: int = opt(0, "CPU threads for torch (0: half the cores, fewer when other processes keep them busy, at "
                          "least 1; OMP_NUM_THREADS, if set, instead; the count is in the plan and config.yaml: "
                          "gspo.processes.threads).", ge=0, resume=True)
    malloc_heap: bool = opt(True,
        "Linux/glibc: serve large CPU tensors (up to 2 GiB) from the heap instead of a fresh mmap each, whose "
        "pages fault on first touch (the mid-size model's update 20% faster; freed memory stays in the process: "
        "peak RSS +9%). false: glibc's own threshold. Thresholds set in the environment (MALLOC_MMAP_THRESHOLD_, "
        "MALLOC_TRIM_THRESHOLD_, GLIBC_TUNABLES) are kept either way (gspo.processes.memory).", resume=True)
    parallel: Literal["ddp", "fsdp"] = opt("ddp",
        "Under torchrun (several processes): ddp replicates the model, fsdp shards parameters, gradients and "
        "optimizer state (FSDP2).")
