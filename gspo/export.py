"""`gspo export`: a run's trained policy as a plain Hugging Face model directory, and its upload.

    gspo export RUN_DIR|CHECKPOINT OUT [--dtype bfloat16] [--step N] [--push-to-hub ORG/NAME [--private]]

    from gspo.export import export, push_to_hub
    out = export("runs/gspo-20261121-201500", "exported/")   # the run's newest checkpoint
    push_to_hub(out, "me/tiny-gspo", private=True)

OUT holds only what `AutoModelForCausalLM.from_pretrained(OUT)` and vLLM read: the weights
(a LoRA adapter merged into its base with PEFT's `merge_and_unload`), `config.json` (its
`dtype` and `torch_dtype` those of the weights), the tokenizer, a `generation_config.json`
whose `eos_token_id` lists the run's stop tokens (gspo.sampling.rollout.stop_token_ids), and a
`README.md` model card that carries the run's configuration. No optimizer, trainer state or
`config.yaml`: nothing a reader of OUT would not know. The weights are in the run's compute
`--dtype` unless `dtype` says otherwise: the precision the policy sampled and was rewarded in.
OUT is written into a temporary directory renamed at the end, so a failed export leaves nothing.

`write` is what `gspo export` and `gspo.Trainer.save_model` share; `Trained` is what it needs
(a checkpoint loaded by `load_trained`, or the trainer's policy in memory).

Left out: quantisation, GGUF and other formats, and sharding options beyond save_pretrained's.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import torch
import tyro
import yaml

from gspo.algo.losses import LOSSES
from gspo.commands.train_command import NOT_IN_COMMAND, train_command
from gspo.config import TrainConfig, to_dict
from gspo.config.yamlfile import load_yaml
from gspo.io.files import read_jsonl
from gspo.io.hub import nearby
from gspo.io.words import plural
from gspo.models.loading import BUILTIN_MODELS, DTYPES, unwrap
from gspo.train import checkpoint as ckpt

if TYPE_CHECKING:
    from gspo.train.run import Run


class ExportError(ValueError):
    """A run that cannot be exported, or an upload that failed; the message is one line."""


@dataclass
class ExportArgs:
    """gspo export: a run's trained policy as a plain Hugging Face model directory (LoRA merged)."""

    source: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="RUN_DIR|CHECKPOINT")]
    """A gspo run directory (its newest checkpoint; --step picks another) or one of its checkpoints/step-N."""
    out: Annotated[str, tyro.conf.Positional, tyro.conf.arg(metavar="OUT")]
    """Directory to write; must not exist or be empty (an export is never overwritten)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Dtype of the exported weights (default: the run's --dtype, the precision the policy sampled in)."""
    step: int | None = None
    """Export the checkpoint of this step instead of the newest."""
    base_model: str | None = None
    (
        "Base model (directory, built-in name or hub id) of a LoRA run: default, the one its adapter records; "
        "required for a run trained from a model object."
    )
    push_to_hub: str | None = None
    """Upload OUT to this Hugging Face Hub repository (ORG/NAME), created if missing."""
    private: bool = False
    """Create the hub repository private (with --push-to-hub)."""


@dataclass
class Trained:
    """A trained policy and what its export says about it."""

    model: object  # a transformers causal LM, or a PEFT model of one (LoRA)
    tokenizer: object
    cfg: TrainConfig  # the run's resolved configuration
    step: int  # training steps behind these weights
    stop_ids: tuple[int, ...]  # the run's stop tokens (gspo.sampling.rollout.stop_token_ids)
    evals: list[dict] = field(default_factory=list)  # held-out evaluations, {"step", "accuracy", "n", ...}
    run_dir: Path | None = None  # for an example prompt (samples.jsonl)
    base_model: str | None = None  # the LoRA base, when it is not cfg.policy.model (--base-model)


# ----------------------------------------------------------------------------------------------
# From a run directory
# ----------------------------------------------------------------------------------------------


def export(source: str | Path, out: str | Path, *, dtype: str | None = None, base_model: str | None = None,
           merge_lora: bool = True, repo_id: str | None = None) -> Path:
    """Export a run directory's newest checkpoint, or a checkpoint (a step's: find_checkpoint), to
    `out` (see `write`). repo_id: the hub repository it is meant for (the model card names it)."""
    path = find_checkpoint(Path(source))
    target = dtype or load_yaml(path / "config.yaml").policy.dtype
    _check_out(Path(out))  # before loading anything
    return write(load_trained(path, dtype=target, base_model=base_model), out, dtype=target, merge_lora=merge_lora,
                 repo_id=repo_id)


def from_run(run: Run) -> Trained | None:
    """What a finished gspo.train.run.Run's policy exports as (gspo.api.Trainer keeps it); None where
    the policy is sharded (FSDP): the run's final checkpoint holds its gathered weights."""
    if run.dist.enabled and run.dist.parallel == "fsdp":
        return None
    base = (
        getattr(unwrap(run.policy).config, "name_or_path", None) if str(run.cfg.policy.model).startswith("<") else None
    )
    return Trained(run.policy, run.tokenizer, run.cfg, run.progress.steps_done, run.stop_ids, list(run.progress.evals),
                   run.run_dir, base or None)


def find_checkpoint(path: Path, step: int | None = None) -> Path:
    """The checkpoint directory `path` names: itself, or a run directory's newest (or `step`'s)."""
    if not path.is_dir():
        raise ExportError(f"RUN_DIR|CHECKPOINT {path}: no such directory (expected a gspo run directory or one of "
                          f"its checkpoints){nearby(str(path))}")
    if (path / "trainer_state.pt").exists() and (path / "config.yaml").exists():
        if step is not None:
            raise ExportError(f"--step: {path} is a checkpoint already; --step picks one of a run directory's")
        return path
    if not (path / "config.yaml").exists():
        raise ExportError(f"RUN_DIR|CHECKPOINT {path}: not a gspo run directory or checkpoint (no config.yaml)")
    found = dict(ckpt.checkpoint_dirs(path))
    if not found:
        raise ExportError(f"RUN_DIR {path}: the run has no checkpoint yet (checkpoints/step-N/)")
    if step is not None and step not in found:
        raise ExportError(f"--step: {path} has no checkpoint of step {step} (it has {', '.join(map(str, found))})")
    return found[max(found) if step is None else step]


def load_trained(path: Path, *, dtype: str, base_model: str | None = None) -> Trained:
    """A checkpoint's policy on the CPU: full weights in `dtype`; a LoRA adapter on its base in
    float32 (merged in float32, then cast once)."""
    from gspo.models.loading import AdapterLoad, load_policy, quiet_peft
    from gspo.sampling.rollout import stop_token_ids

    cfg = load_yaml(path / "config.yaml")
    adapter = (path / "adapter_config.json").exists()
    if adapter and base_model is None and str(cfg.policy.model).startswith("<"):
        raise ExportError(f"{path}: a LoRA adapter of a run trained from a model object ({cfg.policy.model}): its base "
                          "is not recorded; pass --base-model DIR|ID")
    with quiet_peft():  # the base at the run's --revision, as `gspo eval` loads it
        model, tokenizer = load_policy(str(path), dtype=torch.float32 if adapter else DTYPES[dtype],
                                       revision=cfg.policy.revision, adapter=AdapterLoad(base_model))
    state = ckpt.load_trainer_state(path)
    run_dir = path.parent.parent if (path.parent.parent / "config.yaml").exists() else None
    summary = run_dir / "summary.json" if run_dir is not None else None
    evals = json.loads(summary.read_text()).get("evals", []) if summary and summary.exists() else []
    if not any(e.get("step") == state["step"] for e in evals):  # a summary of a longer (resumed) run, or none
        evals = state.get("evals", [])
    return Trained(model, tokenizer, cfg, state["step"], stop_token_ids(tokenizer, model, cfg.sampling.stop_token),
                   evals, run_dir, base_model if adapter else None)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not empty; an export is never overwritten (choose another OUT)")


def write(trained: Trained, out: str | Path, *, dtype: str | None = None, merge_lora: bool = True,
          copy_model: bool = False, repo_id: str | None = None) -> Path:
    """Write `trained` to `out` (atomically: a temporary directory renamed at the end).

    dtype: of the weights (default: the run's --dtype). merge_lora=False writes a LoRA policy's
    adapter alone (PEFT format) instead of merged weights. copy_model: leave `trained.model` as
    it is (the export works on a CPU copy); otherwise it is merged and cast in place.
    """
    out = Path(out)
    name = dtype or trained.cfg.policy.dtype
    if name not in DTYPES:
        raise ExportError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}")
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        model = plain_model(trained.model, DTYPES[name], merge=merge_lora, copy_model=copy_model)
        merged = not hasattr(model, "peft_config")
        model.save_pretrained(tmp)
        trained.tokenizer.save_pretrained(tmp)
        generation_config(model, trained.tokenizer, trained.stop_ids).save_pretrained(tmp)
        if merged:
            _stamp_dtype(tmp / "config.json", name)
        (tmp / "README.md").write_text(model_card(trained, dtype=name, merged=merged, where=repo_id or str(out)))
        os.replace(tmp, out)  # onto an empty directory too (POSIX rename)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written is left
        if isinstance(e, OSError):
            raise ExportError(f"{out}: cannot write the export ({e.strerror or e})") from None
        raise
    return out


def plain_model(model, dtype: torch.dtype, *, merge: bool = True, copy_model: bool = False):
    """The model to save, on the CPU: a LoRA adapter merged into its base (`merge`), every
    parameter in `dtype` (buffers, e.g. RoPE's inv_freq, stay as they are; they are not saved)."""
    model = cpu_copy(model) if copy_model else model.to("cpu")
    if merge and hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype != dtype:
                p.data = p.data.to(dtype)
    return model.eval()


def cpu_copy(model):
    """A copy of `model` on the CPU, made without a second copy on its device (a GPU)."""
    memo = {}
    for t in itertools.chain(model.parameters(), model.buffers()):  # tied weights: once, so they stay tied
        c = t.detach().to("cpu", copy=True)
        memo[id(t)] = torch.nn.Parameter(c, requires_grad=False) if isinstance(t, torch.nn.Parameter) else c
    return copy.deepcopy(model, memo)


def generation_config(model, tokenizer, stop_ids: tuple[int, ...]):
    """The model's generation config with the run's stop tokens as `eos_token_id` and the
    tokenizer's padding token, so `generate` and vLLM stop where the run's rollouts stopped."""
    from transformers import GenerationConfig

    gen = copy.deepcopy(getattr(unwrap(model), "generation_config", None)) or GenerationConfig()
    gen.eos_token_id = list(stop_ids)
    gen.pad_token_id = tokenizer.pad_token_id
    gen._from_model_config = False  # marked so, transformers 4.x may rebuild it from config.json (one eos id)
    return gen


def _stamp_dtype(path: Path, name: str) -> None:
    """config.json names the weights' dtype under both keys: `dtype` (transformers >= 4.56)
    and `torch_dtype` (older transformers, and the vLLM versions that pin them)."""
    cfg = json.loads(path.read_text())
    cfg["dtype"] = cfg["torch_dtype"] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ----------------------------------------------------------------------------------------------
# The model card
# ----------------------------------------------------------------------------------------------

def hub_id(name: str | None) -> str | None:
    """The hub id a model or dataset name stands for, if any: the id itself, or the id of a
    hub cache snapshot directory (`.../models--ORG--NAME/snapshots/<hash>`)."""
    from gspo.io.hub import looks_like_hub_id

    if not name or name in BUILTIN_MODELS or name.startswith("<"):
        return None
    snap = re.search(r"(?:models|datasets)--([^/]+?)--([^/]+)/snapshots/", name)
    if snap:
        return f"{snap.group(1)}/{snap.group(2)}"
    return name if looks_like_hub_id(name) else None


def model_card(t: Trained, *, dtype: str, merged: bool, where: str) -> str:
    """README.md: hub metadata, then what was trained on what, the held-out results, the
    equivalent `gspo train` command and configuration, and how to load it."""
    cfg, base = t.cfg, t.base_model or t.cfg.policy.model
    tags = list(dict.fromkeys(["gspo", "reinforcement-learning", cfg.loss.algorithm.replace("_", "-")]))
    meta = {"library_name": "transformers" if merged else "peft", "tags": tags}
    if hub_id(base):  # the hub accepts only hub ids here
        meta = {"base_model": hub_id(base), **meta}
    if hub_id(cfg.data.dataset):
        meta["datasets"] = [hub_id(cfg.data.dataset)]
    data = f"the dataset `{cfg.data.dataset}`" if cfg.data.dataset else \
        f"reasoning-gym's `{cfg.data.task.split(':', 1)[1]}` task" if cfg.data.task.startswith("reasoning_gym:") else \
        f"gspo's built-in `{cfg.data.task}` task"
    what = "merged LoRA" if merged and cfg.lora.lora_r else "LoRA adapter" if not merged else "full"
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "",
             f"# {where.rstrip('/').split('/')[-1]}", "",
             f"`{base}` fine-tuned with {LOSSES[cfg.loss.algorithm].display} by gspo "
             f"for {plural(t.step, 'step')} on {data} "
             f"(rewards: {', '.join(cfg.rewards.reward) or 'the task default'}); {what} weights in {dtype}.", "",
             *_results(t.evals, t.step), *_training(cfg), *_load_it(t, where, merged)]
    return "\n".join(lines) + "\n"


def _results(evals: list[dict], step: int) -> list[str]:
    before = next((e for e in evals if e.get("step") == 0 and e.get("n")), None)
    after = next((e for e in evals if e.get("step") == step and e.get("n")), None)
    if before is None or after is None:
        return ["## Held-out results", "", f"None recorded for step 0 and step {step} (`--eval-size 0`, or "
                "no evaluation at this step).", ""]
    binary = after.get("binary", True)
    fmt = (lambda v: "n/a" if v is None else f"{100 * v:.1f}%") if binary else \
        (lambda v: "n/a" if v is None else f"{v:.4g}")  # None: the reward scored no completion
    what = "accuracy" if binary else f"mean {after.get('metric', 'reward')}"
    return ["## Held-out results", "",
            f"Greedy decoding on {after['n']} held-out problems, "
            f"scored by `{after.get('metric', 'the first reward')}`:",
            "", f"| | before (step 0) | after (step {step}) |", "| --- | --- | --- |",
            f"| {what} | {fmt(before['accuracy'])} | {fmt(after['accuracy'])} |", ""]


def _training(cfg: TrainConfig) -> list[str]:
    loss, smp, lora = cfg.loss, cfg.sampling, cfg.lora
    adapted = f", adapted from there to hold clip/frac near {loss.target_clip_frac}" if loss.target_clip_frac else ""
    key = {"algorithm": loss.algorithm, "learning rate": cfg.optim.lr, "prompts per step x group size":
           f"{smp.prompts_per_step} x {smp.group_size}", "clip range": f"({loss.clip_low}, {loss.clip_high}){adapted}",
           "loss aggregation": loss.loss_agg, "max new tokens": smp.max_new_tokens, "temperature": smp.temperature,
           "dtype": cfg.policy.dtype,
           **({"LoRA r / alpha": f"{lora.lora_r} / {lora.lora_alpha}"} if lora.lora_r else {})}
    config = {k: v for k, v in to_dict(cfg).items() if k not in NOT_IN_COMMAND}
    return ["## Training", "", "| | |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in key.items()), "",
            "The equivalent command (the options that differ from the defaults):", "", "```bash", train_command(cfg),
            "```", "",
            "<details><summary>The run's configuration (<code>gspo train --config</code> takes it)</summary>", "",
            "```yaml", yaml.safe_dump(config, sort_keys=False).strip(), "```", "", "</details>", ""]


def _example(run_dir: Path | None) -> str:
    """Python code that makes `inputs` from a prompt of the run (its first in samples.jsonl)."""
    rows = read_jsonl(run_dir / "samples.jsonl")[:1] if run_dir is not None else []
    if rows and rows[0].get("messages"):
        return (f"messages = {rows[0]['messages']!r}\ninputs = tokenizer.apply_chat_template(messages, "
                "add_generation_prompt=True, return_dict=True, return_tensors=\"pt\")")
    prompt = rows[0]["prompt"] if rows else "..."  # what the model saw, chat template applied
    return f"inputs = tokenizer({prompt!r}, return_tensors=\"pt\")  # a prompt as in training"


def _load_it(t: Trained, where: str, merged: bool) -> list[str]:
    pkg, cls = ("transformers", "AutoModelForCausalLM") if merged else ("peft", "AutoPeftModelForCausalLM")
    lines = ["## Load it", "", "```python", f"from {pkg} import {cls}", "from transformers import AutoTokenizer", "",
             f"model = {cls}.from_pretrained({where!r})", f"tokenizer = AutoTokenizer.from_pretrained({where!r})",
             _example(t.run_dir), f"out = model.generate(**inputs, max_new_tokens={t.cfg.sampling.max_new_tokens}, "
             "do_sample=False)  # stops at the run's stop tokens",
             "print(tokenizer.decode(out[0, inputs[\"input_ids\"].shape[1]:], skip_special_tokens=True))", "```"]
    if merged:
        lines += ["", "With vLLM (its stop tokens come from `generation_config.json`):", "", "```bash",
                  f"vllm serve {where}", "```"]
    if t.cfg.sampling.stop_string:
        lines += ["", f"The run also ended completions at the strings {list(t.cfg.sampling.stop_string)!r}: pass "
                  "`stop_strings=` (transformers, with `tokenizer=`) or `stop=` (vLLM) to do the same."]
    return lines


# ----------------------------------------------------------------------------------------------
# The hub
# ----------------------------------------------------------------------------------------------


def check_push(repo_id: str, token: str | None = None) -> None:
    """Before any work: `repo_id` is a hub repository id and a token is at hand."""
    from huggingface_hub import get_token
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except Exception as e:
        raise ExportError(f"--push-to-hub: {repo_id!r} is not a hub repository id (ORG/NAME): "
                          f"{' '.join(str(e).split())[:160]}") from None
    if not (token or get_token()):
        raise ExportError(f"--push-to-hub {repo_id}: no Hugging Face token; run `hf auth login` or set HF_TOKEN")


def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, commit_message: str | None = None,
                token: str | None = None) -> str:
    """Upload `folder` to the hub model repository `repo_id` (created if missing, `private`
    then); returns its URL. A missing token or an unreachable hub is one line (ExportError)."""
    from huggingface_hub import HfApi

    check_push(repo_id, token)
    api = HfApi(token=token)
    message = commit_message or f"gspo export: {Path(folder).name}"
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=message, repo_type="model")
    except Exception as e:
        raise ExportError(f"--push-to-hub {repo_id}: {_hub_error(e)}") from None
    return str(url)


def _hub_error(e: Exception) -> str:
    status = getattr(getattr(e, "response", None), "status_code", None)
    if status in (401, 403):
        return f"not allowed (HTTP {status}): the token needs write access to the repository"
    name = type(e).__name__
    if any(k in name for k in ("Connect", "Timeout", "Network", "Transport", "Offline")):
        return f"cannot reach the Hugging Face Hub ({name}: {' '.join(str(e).split())[:120]})"
    return f"{name}: {' '.join(str(e).split())[:200]}"
