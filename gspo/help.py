"""`gspo train --help`: the options of TrainConfig in sections, the algorithms' presets, KL estimators.

The text of every option is its field's docstring in gspo.config (the one source of truth,
also shown by docs/options.md); the sections are gspo.config.HELP_GROUPS.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import shutil
import textwrap
import typing

from gspo.config import LOG_SPACE_CLIP, PRESETS, TrainConfig

# `gspo train --help` sections, in order (every field in one; tests/test_cli.py checks)
HELP_GROUPS: dict[str, tuple[str, ...]] = {
    "model": ("model", "revision", "dtype", "param_dtype", "gradient_checkpointing", "lora_r", "lora_alpha", "lora_dropout",
              "lora_target_modules"),
    "data": ("task", "dataset", "dataset_config", "dataset_split", "eval_dataset", "eval_split", "prompt_column", "answer_column",
             "system_prompt", "max_prompt_length"),
    "rewards": ("reward", "reward_weights", "format_pattern", "reward_model_device", "reward_model_batch_size"),
    "algorithm": ("algorithm", "num_minibatches", "epochs", "clip_low", "clip_high", "loss_agg", "adv_scale", "beta",
                  "kl_estimator", "old_logp", "mask_truncated_completions", "sapo_tau_pos", "sapo_tau_neg"),
    "sampler/trainer mismatch corrections": ("rollout_is", "rollout_is_mode", "rollout_is_low", "rollout_is_high",
                                             "opsm_delta"),
    "PPO's value model": ("critic", "critic_lr", "gamma", "gae_lambda", "value_clip", "vf_coef", "whiten_advantages",
                          "reward_kl_coef"),
    "sampling": ("steps", "prompts_per_step", "group_size", "max_new_tokens", "min_new_tokens", "temperature",
                 "top_p", "top_k", "stop_token", "stop_string", "rollout_engine", "rollout_dtype",
                 "vllm_gpu_memory_utilization", "vllm_kv_cache_gib", "vllm_max_model_len", "vllm_sleep"),
    "multi-turn episodes": ("env", "max_turns", "max_episode_tokens", "turn_advantages"),
    "optimisation": ("lr", "weight_decay", "adam_betas", "max_grad_norm", "lr_schedule", "warmup_steps",
                     "micro_batch_tokens", "packing"),
    "Mixture-of-Experts": ("routing_replay", "router_aux_loss_coef"),
    "evaluation and logging": ("eval_size", "eval_every", "seed", "output_dir", "save_every", "keep_checkpoints",
                               "samples_per_step", "progress", "report_to", "wandb_project"),
    "devices and distributed": ("device", "threads", "parallel"),
}

INTRO = """usage: gspo train [--config FILE] [--resume RUN_DIR] [OPTIONS]

Train a policy with GSPO (the default), GSPO-token, GRPO, PPO, CISPO, SAPO or GMPO: sample a
group of completions per prompt, score them, turn rewards into advantages, and update with a
clipped (or gated) objective.
Every option is also a key of a YAML file given with --config (underscores for dashes);
--resume RUN_DIR continues a run (options that are safe to change may be given with it).

algorithms and their presets (the clip range applies unless --clip-low/--clip-high say otherwise):
{presets}
KL penalty (--beta > 0) per sampled token, ρ = π_ref/π: k1 = -log ρ has an expected gradient of
0 (no pull at all); k2 = ½ (log ρ)² pulls along ∇KL(π‖π_ref); k3 = ρ - 1 - log ρ (default)
along the reverse ∇KL(π_ref‖π), as in GRPO. See docs/library.md.
"""

ALGORITHMS = {
    "gspo": "sequence ratio s_i, one clipped term per response (paper Eq. 5)",
    "gspo_token": "GSPO's ratio per token, for per-token advantages (Eq. 13)",
    "grpo": "token ratios, each token clipped on its own (Eq. 2)",
    "ppo": "token ratios with GAE advantages from a learned value model (Eq. 1)",
    "cispo": "token ratios as detached, clipped weights of log π: no gradient is cut (MiniMax-M1)",
    "sapo": "token ratios through a soft sigmoid gate instead of a clip (Qwen SAPO)",
    "gmpo": "geometric mean of token ratios clipped in log space, one term per response (GMPO)",
}


def field_docs(cls=TrainConfig) -> dict[str, str]:
    """Docstrings written under dataclass fields (what tyro also shows)."""
    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _flag(name: str, hint) -> str:
    flag = "--" + name.replace("_", "-")
    args = typing.get_args(hint)
    if hint is bool:
        return f"{flag}, --no-{name.replace('_', '-')}"
    if typing.get_origin(hint) is typing.Literal:
        return f"{flag} {{{','.join(map(str, args))}}}"
    if typing.get_origin(hint) is tuple:
        return f"{flag} {'VALUE [VALUE ...]' if Ellipsis in args else ' '.join(['VALUE'] * len(args))}"
    kind = next((a for a in args if a is not type(None)), hint) if args else hint
    return f"{flag} {getattr(kind, '__name__', 'VALUE').upper()}"


def _clip_range(name: str, preset: dict) -> str:
    low, high = preset["clip_low"], preset["clip_high"]
    if name == "sapo":
        return f"gate τ {TrainConfig.sapo_tau_pos:g} / {TrainConfig.sapo_tau_neg:g}"
    if name in LOG_SPACE_CLIP:
        return f"log-ratio clip [-{low:g}, {high:g}]"
    return f"clip [1 - {low:g}, 1 + {high:g}]"


def train_help(width: int | None = None) -> str:
    width = width or min(110, shutil.get_terminal_size((100, 20)).columns)
    docs, hints = field_docs(), typing.get_type_hints(TrainConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    presets = "".join(f"  {name:<11} {_clip_range(name, p)}: {ALGORITHMS.get(name, '')}\n"
                      for name, p in PRESETS.items())
    out = [INTRO.format(presets=presets)]
    for group, names in HELP_GROUPS.items():
        out.append(f"{group}:")
        for name in names:
            text = f"{docs.get(name, '')} (default: {defaults[name]})"
            out.append(f"  {_flag(name, hints[name])}")
            out += textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
        out.append("")
    return "\n".join(out)
