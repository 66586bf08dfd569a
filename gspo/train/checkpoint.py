"""Run directories and checkpoints, written so that a run killed at any moment resumes.

    run_dir/
      config.yaml            the resolved configuration
      fingerprint.json       the gspo version, the sha256 of its local files (gspo.train.fingerprint)
      metrics.jsonl          one JSON object per step
      samples.jsonl          a few prompts, completions and rewards per step
      summary.json           accuracy before/after, wall time (written at the end)
      checkpoints/step-000020/
        config.json, model.safetensors, tokenizer files   (save_pretrained: loads with HF)
        trainer_state.pt     LR scheduler, loss scaler and RNG states, step, evaluations, the clip range
                             --target-clip-frac holds
        optimizer.pt         AdamW states (policy, and a separate critic's)
        config.yaml          the run's configuration

Atomicity: a checkpoint is written into `checkpoints/.tmp-step-N/`, flushed to disk, and
renamed to `step-N` in one `os.replace`; a directory named `step-N` is therefore always
complete. Files that are rewritten (summary.json, config.yaml, fingerprint.json, the trimmed jsonl logs) go
through a temporary file and a rename too. Appended logs (metrics.jsonl, samples.jsonl) may
hold steps past the last checkpoint when a run dies; `resume` trims them back so that the
resumed run appends exactly what an uninterrupted run would have written.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
import yaml

from gspo.algo.clipcontrol import ClipController
from gspo.config import TrainConfig, to_dict
from gspo.io.files import _fsync_dir, atomic_write_text, trim_jsonl
from gspo.processes import parallel
from gspo.train.fingerprint import write_fingerprint

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gspo.processes.distributed import Dist
    from gspo.sampling.pipeline import Pipeline
    from gspo.sampling.produce import Produced  # the sampler's imports (transformers) stay out of `gspo compare --help`
    from gspo.train.optim import Trainable

@dataclass
class Progress:
    """Where a run stands: restored from its checkpoint, advanced step by step, saved in every
    checkpoint (gspo.train.checkpoint)."""

    start_step: int = 0  # the step this process started after (0, or the checkpoint's)
    steps_done: int = 0
    restart: bool = False  # resumed, but killed before its first checkpoint: started over from step 0
    eval_before: dict | None = None  # the held-out evaluation before step 1
    evals: list[dict] = field(default_factory=list)  # {"step": s, ...} each evaluation so far
    t_start: float = field(default_factory=time.time)  # less the checkpoint's wall time, resumed
    eval_seconds: float = 0.0  # spent evaluating in this process (summary.json's eval_seconds)
    pending: list[Produced] = field(default_factory=list)  # sampled batches not yet trained, restored
    pending_dropped: int = 0  # ... saved by another number of processes: sampled again
    clip: ClipController | None = None  # --target-clip-frac: the clip range of the next step's updates
    warned: set[str] = field(default_factory=set)  # warnings said once a run (gspo.train.trainer)


class Saved(Protocol):
    """What a checkpoint saves and restores of a run (a gspo.train.run.Run is one)."""

    cfg: TrainConfig
    dist: Dist
    policy: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    run_dir: Path
    resume_from: Path | None
    trainables: list[Trainable]
    critic: object  # gspo.train.critic's: what `saved(dist)` returns goes into the checkpoint
    progress: Progress
    pipeline: Pipeline | None

    @property
    def scaler(self) -> torch.amp.GradScaler | None: ...


STEP_DIR = re.compile(r"^step-(\d+)$")
LOCK = ".lock"

# gspo 0.2 kept its modules flat (gspo.produce, gspo.data, ...); a checkpoint it wrote names the
# classes of its pickled objects (the sampled batches not yet trained) by those paths. Room ->
# "old" (same name in the room) or "old:new".
_FLAT_0_2 = {
    "algo": "losses aggregation advantages corrections metrics",
    "config": "configfile:yamlfile aliases:trl checks",
    "io": "files hub reporting words",
    "models": "models:loading gguf_models:gguf tiny moe fastmoe lmhead logprobs sequences value",
    "processes": "distributed parallel links threads",
    "tasks": "data env scoring",
    "rewards": "rewards:builtin reward_model:model",
    "sampling": "rollout samplers produce pipeline vllm_engine fastdecode turncache episodes",
    "train": "trainer run resolve batch optim critic checkpoint lifecycle plan steplog evaluation",
    "lab": "compare studies report stats plot variance jobs",
    "commands": "argv help command:train_command eval_command:eval tasks_command:tasks",
}
MOVED_0_2 = {f"gspo.{old}": f"gspo.{room}.{new or old}" for room, names in _FLAT_0_2.items()
             for old, _, new in (n.partition(":") for n in names.split())}
# gspo 0.3's room gspo.dist is gspo.processes (ruff and pytest skip folders named dist)
MOVED_0_2 |= {f"gspo.dist.{old}": f"gspo.processes.{old}" for old in _FLAT_0_2["processes"].split()}


class _Unpickler(pickle.Unpickler):
    """Reads a gspo 0.2 checkpoint too: a class pickled under a flat module is found in its room."""

    def find_class(self, module: str, name: str):
        return super().find_class(MOVED_0_2.get(module, module), name)


class _pickle:
    """The pickle module torch.load is given: pickle's, with the Unpickler above."""

    Unpickler = _Unpickler
    load = staticmethod(pickle.load)
    loads = staticmethod(pickle.loads)


def checkpoint_dirs(run_dir: Path) -> list[tuple[int, Path]]:
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = STEP_DIR.match(p.name)
        if m and (p / "trainer_state.pt").exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1][1] if dirs else None


@dataclass
class Content:
    """What a checkpoint holds: the model (written with save_pretrained, loads with Hugging Face)
    and its tokenizer, the trainer state, the configuration, the optimizer states, and extra
    models in sub-directories (name -> (module, full state dict or None))."""

    model: torch.nn.Module  # a transformers model, or a PEFT model of one (LoRA)
    tokenizer: PreTrainedTokenizerBase
    state: dict  # trainer_state.pt
    config_yaml: str
    optimizers: dict | None = None  # optimizer.pt
    model_state_dict: dict | None = None  # the full state dict to write in place of the module's own (FSDP)
    extra_models: dict = field(default_factory=dict)  # e.g. "critic" -> (Critic, its full state dict or None)


def save_checkpoint(run_dir: Path, step: int, content: Content, *, keep: int) -> Path:
    """Write checkpoint `step` atomically; delete all but the newest `keep` checkpoints.

    A state dict of None (the model's, an extra model's) means the module's own; FSDP passes
    the gathered one.
    """
    root = run_dir / "checkpoints"
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    previous = latest_checkpoint(run_dir)
    try:
        _write_checkpoint(tmp, content)
        if final.exists():  # same step written again (e.g. re-run of the final save)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)  # give the space back; the previous checkpoint stays whole
        raise WriteError(f"{final}: cannot write the checkpoint ({e.strerror or e}); the previous one, "
                         f"{previous.name if previous else 'none'}, is intact") from None
    for _, old in checkpoint_dirs(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _save_pretrained(model, directory: Path, state_dict: dict | None) -> None:
    import warnings

    with warnings.catch_warnings():  # PEFT looks for the base's config.json beside a LoRA base named by its .gguf
        warnings.filterwarnings("ignore", message=r"Could not find a config file in .*\.gguf - will assume")
        if state_dict is not None:
            model.save_pretrained(directory, state_dict=state_dict)
        else:
            model.save_pretrained(directory)


def _write_checkpoint(tmp: Path, content: Content) -> None:
    """Everything of a checkpoint into `tmp`, flushed to disk."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    _save_pretrained(content.model, tmp, content.model_state_dict)
    content.tokenizer.save_pretrained(tmp)
    for name, (extra, state_dict) in content.extra_models.items():
        _save_pretrained(extra, tmp / name, state_dict)
    (tmp / "config.yaml").write_text(content.config_yaml)
    torch.save(content.state, tmp / "trainer_state.pt")
    if content.optimizers is not None:  # apart, so that a resuming process that does not need it never loads it
        torch.save(content.optimizers, tmp / "optimizer.pt")
    for f in tmp.rglob("*"):
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    pause = os.environ.get("GSPO_TEST_PAUSE_IN_CHECKPOINT")  # tests: kill a run in the middle of a write
    if pause:
        (tmp / "WRITING").touch()
        time.sleep(float(pause))
        (tmp / "WRITING").unlink()


class WriteError(ValueError):
    """A checkpoint or log could not be written (disk full, no permission); one line."""


def is_empty_run_dir(run_dir: Path) -> bool:
    """Nothing in it but (maybe) a lock file."""
    return not run_dir.exists() or all(p.name == LOCK for p in run_dir.iterdir())


def is_complete(run_dir: Path, steps: int) -> dict | None:
    """The summary of a run that has done `steps` steps, or None."""
    path = run_dir / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    return summary if summary.get("steps", -1) >= steps else None


def clean_partial(run_dir: Path) -> None:
    """Remove checkpoint directories left half-written by a killed run."""
    root = run_dir / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=False, pickle_module=_pickle)


def load_optimizers(ckpt: Path, state: dict) -> dict:
    """The optimizer states of a checkpoint (older checkpoints kept them in trainer_state.pt)."""
    if (ckpt / "optimizer.pt").exists():
        return torch.load(ckpt / "optimizer.pt", map_location="cpu", weights_only=False, pickle_module=_pickle)
    return {k: state[k] for k in ("optimizer", "critic_optimizer") if k in state}


# ----------------------------------------------------------------------------------------------
# A whole run: save and restore
# ----------------------------------------------------------------------------------------------


def rng_state() -> dict:
    """Global RNG states (dropout in LoRA, user code); gspo's own draws use per-step generators."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def config_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_run(run: Saved, step: int) -> None:
    """Checkpoint `step` of a gspo.train.run.Run: weights (and the critic's: gspo.train.critic), each
    trainable's optimizer and scheduler states, loss-scaler and RNG states, and where the run
    stands. Under FSDP the gathers are collectives: every process takes part, rank 0 writes."""
    dist = run.dist
    rngs = dist.gather_objects(rng_state())  # every process's, in rank order
    pending = [p.on("cpu") for p in run.pipeline.drain()] if run.pipeline is not None else []
    state = {"step": step, "rng": rngs[dist.rank], "rng_per_rank": rngs, "world_size": dist.world,
             "policy_version": step,
             # batches sampled, not trained
             "pending_per_rank": dist.gather_objects(pending),
             "eval_before": run.progress.eval_before, "evals": run.progress.evals,
             "wall_seconds": time.time() - run.progress.t_start}
    if run.progress.clip is not None:  # --target-clip-frac: the range the next step uses
        state["clip_controller"] = run.progress.clip.state_dict()
    optimizers = {}
    for t in run.trainables:  # "optimizer"/"scheduler", and a separate critic's "critic_optimizer"/...
        optimizers[t.keys[0]] = parallel.optimizer_state(t.model, t.optimizer, dist)
        state[t.keys[1]] = t.scheduler.state_dict()
    if run.scaler is not None:
        state["scaler"] = run.scaler.state_dict()
    # LoRA: the adapter alone is written (PEFT's save_pretrained), so only it is gathered
    content = Content(run.policy, run.tokenizer, state, config_yaml(run.cfg), optimizers,
                      parallel.full_state_dict(run.policy, dist, trainable_only=run.cfg.lora.lora_r > 0),
                      run.critic.saved(dist))  # "value_head" or "critic"
    if dist.is_main:
        save_checkpoint(run.run_dir, step, content, keep=run.cfg.run.keep_checkpoints)
    dist.barrier()


def start_run(run: Saved) -> None:
    """A run's first write: its configuration and fingerprint. A restart (resumed, but killed before
    its first checkpoint) drops what it had logged, so the run appends what an uninterrupted one would."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    clean_partial(run.run_dir)
    for log in ("metrics.jsonl", "samples.jsonl"):
        trim_jsonl(run.run_dir / log, 0)
    atomic_write_text(run.run_dir / "config.yaml", config_yaml(run.cfg))
    write_fingerprint(run.run_dir, run.cfg)  # after config.yaml: a directory with it alone is a run


def restore_run(run: Saved) -> None:
    """Continue a gspo.train.run.Run from `run.resume_from` (its weights are loaded already): the
    optimizer, scheduler, loss-scaler and RNG states, and where the run stood; the logs are
    trimmed back to the checkpoint's step so the resumed run appends what an uninterrupted one
    would. Under FSDP only rank 0 reads the optimizer states and sends each process its shard."""
    dist = run.dist
    if dist.is_main:
        clean_partial(run.run_dir)
    state = load_trainer_state(run.resume_from)
    sharded = dist.enabled and dist.parallel == "fsdp"
    optimizers = load_optimizers(run.resume_from, state) if dist.is_main or not sharded else {}
    for t in run.trainables:  # the policy's, and a separate critic's
        parallel.load_optimizer_state(t.model, t.optimizer, optimizers.get(t.keys[0], {}), dist)
        t.scheduler.load_state_dict(state[t.keys[1]])
    if run.scaler is not None:
        run.scaler.load_state_dict(state["scaler"])
    per_rank = state.get("rng_per_rank") or [state["rng"]]
    set_rng_state(per_rank[dist.rank] if len(per_rank) == dist.world else state["rng"])
    run.progress.start_step, run.progress.eval_before, run.progress.evals = (
        state["step"], state["eval_before"], state.get("evals", [])
    )
    pending = state.get("pending_per_rank") or [[]]
    run.progress.pending = [p.on(dist.device) for p in pending[dist.rank]] if len(pending) == dist.world else []
    # another process count
    run.progress.pending_dropped = 0 if len(pending) == dist.world else sum(map(len, pending))
    # the final evaluation ran after this checkpoint was written
    done = is_complete(run.run_dir, run.progress.start_step)
    if done is not None and done.get("steps") == run.progress.start_step:
        run.progress.evals = [e for e in done.get("evals", []) if e["step"] <= run.progress.start_step]
    run.progress.steps_done = run.progress.start_step
    run.progress.t_start -= state["wall_seconds"]
    if run.progress.clip is not None and "clip_controller" in state:
        run.progress.clip.load_state_dict(state["clip_controller"])
    if dist.is_main:
        trim_jsonl(run.run_dir / "metrics.jsonl", run.progress.start_step)
        trim_jsonl(run.run_dir / "samples.jsonl", run.progress.start_step)
