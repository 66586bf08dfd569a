"""On-policy distillation: the run's teachers, and their log-probs of the student's own tokens.

    teachers = load_teachers(cfg, task, tokenizer, device)     # None without --teacher; checked, one line a fault
    teacher_logp, covered = teachers.logprobs(run, batch, split)   # (B, T), (B,) bool: the rows a teacher scored

The student samples as in RL; a frozen teacher scores each sampled token in the student's context,
log π_T(y_t | x, y_<t), and gspo.train.batch.prepare adds λ·(log π_T − log π_S) to each token's
advantage (gspo.algo.advantages.distill_advantages). A teacher is one of:

- local: any model `--model` takes (built-in name, directory, gspo checkpoint, Hub id, .gguf),
  loaded frozen on the trainer's device, in --teacher-dtype (same: the compute --dtype); under FSDP
  sharded as the reference is;
- served: an OpenAI-compatible server's URL whose /v1/completions returns prompt log-probs (vLLM),
  through gspo.sampling.teacher_server.ServedTeacher; the raw log-probs (temperature 1), so a run
  sampling at another --temperature is refused;
- `self`: the policy itself, frozen at the step (its weights before the step's updates), which
  sees privileged context the student does not (--teacher-context; self-distillation).

The teacher sees the student's exact context: the prompt tokens and the completion columns as
sampled, environment tokens included (context: out of the loss, as in training). With
--teacher-context the prompt is re-rendered with the template's text appended to its last
message (gspo.sampling.episodes.with_suffix), and the completion tokens follow unchanged. The
tokenizers must be the same vocabulary (cross-tokenizer distillation is out of scope); a teacher
whose vocabulary differs is refused at the start, naming both.

`--teacher NAME=TEACHER` gives a reasoning-gym mix's task NAME its own teacher (multi-teacher, as
NeMo-RL's MOPD); a teacher without a name serves the rows no named one does, and rows no teacher
serves get no distillation term.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass

import torch

from gspo.config import ConfigError, TrainConfig
from gspo.io.words import plural
from gspo.models.loading import DTYPES, ModelError, load_policy, load_tokenizer, resolve_model_path
from gspo.models.logprobs import Split, token_logprobs
from gspo.models.sequences import Rollout, left_pad
from gspo.processes import parallel

Tensor = torch.Tensor

SELF = "self"
_NAMED = re.compile(r"^([A-Za-z_][\w.-]*)=(.+)$")  # NAME=TEACHER (a URL's or path's '=' comes after a '/' or ':')


def is_url(spec: str) -> bool:
    return spec.startswith(("http://", "https://"))


def teacher_specs(cfg: TrainConfig) -> list[tuple[str | None, str]]:
    """(task name or None, teacher) for each --teacher (and --teacher-url); [] without distillation."""
    out = []
    for spec in (*cfg.distill.teacher, *([cfg.distill.teacher_url] if cfg.distill.teacher_url else [])):
        m = _NAMED.match(spec)
        out.append((m.group(1), m.group(2)) if m and not is_url(spec) else (None, spec))
    return out


def distill_rules(cfg: TrainConfig):
    """(ok, option, message) for the distillation options' rules (gspo.train.resolve.validate)."""
    specs, d = teacher_specs(cfg), cfg.distill
    rewards = cfg.rewards.reward
    none = "none" in rewards
    yield not (d.teacher and d.teacher_url), "teacher_url", \
        "names the served teacher, and --teacher is given too: give the server as --teacher URL (a task's as NAME=URL)"
    yield not (specs and cfg.loss.algorithm == "ppo"), "teacher", \
        "cannot be combined with --algorithm ppo: the teacher's per-token term is added to group-relative " \
        "advantages, and PPO's come from its critic (use grpo, gspo_token, gspo or another group-relative loss)"
    yield not (none and len(rewards) > 1), "reward", "none cannot be combined with other rewards"
    yield not (none and not specs), "reward", \
        "none trains on nothing without a teacher (give --teacher MODEL for distillation alone)"
    yield not (none and cfg.rewards.reward_weights), "reward_weights", "has nothing to weigh with --reward none"
    yield not (none and cfg.async_rl.drop_uniform_groups), "drop_uniform_groups", \
        "would drop every group with --reward none (no reward: every group is uniform)"
    defaults = [s for name, s in specs if name is None]
    yield len(defaults) <= 1, "teacher", \
        f"{plural(len(defaults), 'teacher')} without a task name ({', '.join(defaults)}): give one, and name the " \
        "others' tasks (NAME=TEACHER)"
    names = [name for name, _ in specs if name is not None]
    yield len(set(names)) == len(names), "teacher", "names a task twice"
    yield not (not d.teacher_context and any(s == SELF for _, s in specs)), "teacher_context", \
        "is needed by --teacher self: without privileged context the teacher is the student and its signal is 0"
    yield not (any(s == SELF for _, s in specs) and cfg.loss.old_logp == "sampling"
               and cfg.async_rl.max_staleness > 0), "old_logp", \
        "sampling with --teacher self and --max-staleness > 0 puts the weights' drift into the term: the teacher is " \
        "the policy at the step, the student's log-probs the stale sampler's (log π_k(y|x,ctx) − log π_k−s(y|x)); " \
        "use --old-logp recompute (the default there)"
    yield not (d.teacher_context and cfg.data.max_prompt_length > 0), "teacher_context", \
        "cannot be combined with --max-prompt-length: the teacher's prompt, longer by the context, would be cut " \
        "where the student's was not (or past the model's positions)"
    yield not (d.teacher_context is not None and not specs), "teacher_context", \
        "is the teacher's, and no --teacher is given"
    yield not (any(is_url(s) for _, s in specs) and cfg.sampling.temperature != 1.0), "teacher", \
        f"a served teacher returns raw log-probs (temperature 1), and --temperature is {cfg.sampling.temperature:g}: " \
        "the student's would be tempered and the teacher's not (use a local teacher, or --temperature 1)"
    yield not (d.teacher_dtype != "same" and specs and all(s == SELF or is_url(s) for _, s in specs)), \
        "teacher_dtype", "applies to a local teacher, and no teacher given is local"


# ----------------------------------------------------------------------------------------------
# The teachers
# ----------------------------------------------------------------------------------------------


@dataclass
class Teacher:
    """One teacher and the task it serves."""

    spec: str  # as given: a model, a URL or "self"
    task: str | None  # the reasoning-gym task it serves (NAME=TEACHER); None: the rows no named teacher serves
    model: torch.nn.Module | None = None  # a local teacher, frozen
    served: object | None = None  # gspo.sampling.teacher_server.ServedTeacher

    @property
    def kind(self) -> str:
        return "self" if self.spec == SELF else "served" if self.served is not None else "local"

    def describe(self) -> str:
        where = "the policy frozen at the step" if self.kind == "self" else "served" if self.kind == "served" else \
            f"local, {_dtype_name(self.model)}"
        return f"{self.task + '=' if self.task else ''}{self.spec} ({where})"


@dataclass
class Teachers:
    """The run's teachers, the privileged context they see, and how they score a batch."""

    teachers: list[Teacher]
    context: str | None = None  # --teacher-context's template

    def describe(self, cfg: TrainConfig, per_token: bool) -> str:
        """The plan's line."""
        shape = "per token" if per_token else \
            f"one per response (its tokens' mean: --algorithm {cfg.loss.algorithm}'s sequence ratio takes one)"
        rewards = "alone (--reward none)" if "none" in cfg.rewards.reward else "plus the reward's group advantages"
        ctx = f"; the teacher also reads {self.context!r}" if self.context else ""
        return (f"distillation: {'; '.join(t.describe() for t in self.teachers)}; advantage "
                f"{cfg.distill.distill_coef:g}·(log π_teacher − log π_student) {shape}, {rewards}{ctx}")

    def assign(self, examples: list) -> list[int]:
        """Each row's teacher (an index into `teachers`; -1: none serves it)."""
        named = {t.task: i for i, t in enumerate(self.teachers) if t.task is not None}
        default = next((i for i, t in enumerate(self.teachers) if t.task is None), -1)
        return [named.get(task_name(ex), default) for ex in examples]

    @torch.no_grad()
    def logprobs(self, run, ro: Rollout, examples: list, split: Split) -> tuple[Tensor, Tensor]:
        """log π_T of every completion token of `ro` (B, T), 0 where no teacher serves the row, and
        (B,) bool: the rows a teacher served. run: a gspo.train.run.Run; examples: each row's Example.
        Every process enters every teacher's gathered parameters (collective under FSDP), rows or none."""
        B, T = ro.completion_ids.shape
        out = ro.logp.new_zeros((B, T), dtype=torch.float32)
        owner = torch.tensor(self.assign(examples), dtype=torch.long)  # (B,)
        temperature = run.cfg.sampling.temperature
        for i, teacher in enumerate(self.teachers):
            idx = (owner == i).nonzero().flatten()
            sub = ro.select(idx.to(ro.prompt_ids.device)) if len(idx) else None
            if sub is not None and self.context is not None:
                sub = self.with_context(sub, [examples[int(b)] for b in idx], run.tokenizer)
            if teacher.kind == "served":
                if sub is not None:
                    out[idx] = served_logprobs(teacher.served, sub).to(out)
                continue
            model, root = (run.policy, run.train_model) if teacher.kind == "self" else (teacher.model, teacher.model)
            auto = run.autocast() if teacher.kind == "self" else contextlib.nullcontext()
            with auto, parallel.gathered(root, run.dist):
                if sub is not None:
                    out[idx] = token_logprobs(model, sub, temperature=temperature, split=split)[0].float()
        return out, owner >= 0

    def with_context(self, ro: Rollout, examples: list, tokenizer) -> Rollout:
        """`ro` with each row's prompt re-rendered with the privileged context appended to its last
        message; the completion columns unchanged."""
        from gspo.sampling.episodes import with_suffix  # (these import transformers: gspo.train.resolve does not)
        from gspo.sampling.rollout import encode_prompts

        prompts = [with_suffix(ex.prompt, _row_context(self.context, ex)) for ex in examples]
        ids, mask = left_pad(encode_prompts(tokenizer, prompts), tokenizer.pad_token_id, device=ro.prompt_ids.device)
        return dataclasses.replace(ro, prompt_ids=ids, prompt_mask=mask.to(ro.prompt_mask.dtype), routing=None)


def _dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def task_name(example) -> str | None:
    """The reasoning-gym task of a mix's example (its entry's metadata source_dataset); None otherwise."""
    entry = example.columns.get("entry") if hasattr(example, "columns") else None
    if isinstance(entry, dict):
        return (entry.get("metadata") or {}).get("source_dataset")
    return None


def context_text(template: str, example) -> str:
    """--teacher-context filled with the example's fields (its row: prompt, answer, the dataset's columns)."""
    return template.format_map(example.row())


def _row_context(template: str, example) -> str:
    """context_text mid-run: a row without a field the template names (a generated task's) is one line."""
    try:
        return context_text(template, example)
    except KeyError as e:
        raise ConfigError(f"teacher_context: names the field {e.args[0]!r}, which {example.source or 'a row'} does "
                          f"not have (its fields: {', '.join(sorted(example.row()))})") from None


def served_logprobs(served, ro: Rollout) -> Tensor:
    """A served teacher's log-probs of `ro`'s completion columns (B, T): each row sent as its
    unpadded prompt and its completion up to the last token attended (environment tokens included)."""
    B, T = ro.completion_ids.shape
    seen = ro.attention_mask[:, ro.prompt_ids.shape[1]:].cpu()  # (B, T)
    seqs, starts, lengths = [], [], []
    for b in range(B):
        prompt = ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist()
        on = seen[b].nonzero()
        n = int(on.max()) + 1 if len(on) else 0
        seqs.append(prompt + ro.completion_ids[b, :n].tolist())
        starts.append(len(prompt))
        lengths.append(n)
    got = served.logprobs(seqs, starts) if B else []
    out = torch.zeros(B, T, dtype=torch.float32)
    for b, (n, lp) in enumerate(zip(lengths, got)):
        out[b, :n] = torch.tensor(lp[:n], dtype=torch.float32)
    return out


# ----------------------------------------------------------------------------------------------
# Loading, with every check before anything is written
# ----------------------------------------------------------------------------------------------


def load_teachers(cfg: TrainConfig, task, tokenizer, device: torch.device, *, env=None) -> Teachers | None:
    """The run's teachers, loaded and checked (None without --teacher). A ConfigError or ModelError
    of one line for: a task name outside the mix, a context field the examples lack, a context with
    multi-turn episodes, a teacher that cannot be loaded or served, a vocabulary not the student's."""
    specs = teacher_specs(cfg)
    if not specs:
        return None
    mix = [name for name, _ in getattr(task, "mix", [])]
    for name, _ in specs:
        if name is not None and name not in mix:
            raise ConfigError(f"teacher: {name}= names a task that is not in --task {cfg.data.task} "
                              f"({'its tasks: ' + ', '.join(mix) if mix else 'not a reasoning-gym mix'})")
    context = cfg.distill.teacher_context
    if context is not None:
        if env is not None:
            raise ConfigError("teacher_context: multi-turn episodes are not supported (the context would be added "
                              "to a prompt the environment also extends)")
        _check_context(context, task)
    dtype = DTYPES[cfg.policy.dtype if cfg.distill.teacher_dtype == "same" else cfg.distill.teacher_dtype]
    teachers = []
    for name, spec in specs:
        if spec == SELF:
            teachers.append(Teacher(spec, name))
        elif is_url(spec):
            teachers.append(Teacher(spec, name, served=_served(spec, tokenizer)))
        else:
            teachers.append(Teacher(spec, name, model=_local(spec, tokenizer, dtype, device)))
    return Teachers(teachers, context)


def _check_context(template: str, task) -> None:
    """The template fills from every row a task holds (a dataset's train and eval lists), else from its
    first evaluation or training example: a field some rows lack is refused at the start, naming one."""
    held = [*(getattr(task, "train", None) or []), *(getattr(task, "eval", None) or [])]
    held = [ex for ex in held if hasattr(ex, "row")]
    examples = held or task.test_set(1) or task.train_batch(0, 1)
    if not examples:
        return
    for example in examples:
        try:
            _row_context(template, example)  # a missing field: its one line
        except ConfigError:
            raise
        except (ValueError, IndexError) as e:
            raise ConfigError(f"teacher_context: not a template of the example's fields ({e}); write {{answer}} "
                              "for a field and {{ }} for a brace") from None


def _served(url: str, tokenizer):
    from gspo.sampling.teacher_server import ServedTeacher

    served = ServedTeacher(url)
    served.check(tokenizer)
    return served


def _local(spec: str, tokenizer, dtype: torch.dtype, device) -> torch.nn.Module:
    path = resolve_model_path(spec)
    if (path / "adapter_config.json").exists():
        model, theirs = load_policy(spec, dtype=dtype, device=device)
        model = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model
    else:
        theirs = load_tokenizer(path, spec)
        model, _ = load_policy(spec, dtype=dtype, device=device, with_tokenizer=False)
    check_vocabulary(spec, theirs, tokenizer, model)
    return model.eval().requires_grad_(False)


def check_vocabulary(spec: str, theirs, ours, model=None) -> None:
    """The teacher's tokenizer is the student's: the same token for every id. A one-line
    ModelError naming both vocabularies otherwise."""
    a, b = theirs.get_vocab(), ours.get_vocab()
    if a != b:
        inv_a, inv_b = {i: t for t, i in a.items()}, {i: t for t, i in b.items()}
        first = next((i for i in sorted(set(inv_a) | set(inv_b)) if inv_a.get(i) != inv_b.get(i)), None)
        raise ModelError(f"teacher {spec}: its tokenizer is not the student's: the teacher's vocabulary has "
                         f"{len(a)} tokens ({_name(theirs)}), the student's {len(b)} ({_name(ours)}); token id {first} "
                         f"is {inv_a.get(first)!r} for the teacher and {inv_b.get(first)!r} for the student "
                         "(cross-tokenizer distillation is not supported)")
    rows = model.get_output_embeddings().weight.shape[0] if model is not None else None
    if rows is not None and rows < len(b):
        raise ModelError(f"teacher {spec}: its output layer scores {rows} tokens, fewer than the student's "
                         f"vocabulary of {len(b)}")


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
