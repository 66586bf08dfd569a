"""Rewards: verifiers and the plumbing that applies them to a batch of completions.

A reward is batched and called by keyword as TRL's GRPOTrainer calls it, so TRL's reward functions
work unchanged (`def f(completions, **kwargs)`, `def f(prompts, completions, answer, **kwargs)`):

    fn(prompts=[...], completions=[...], completion_ids=[...], trainer_state=..., **columns) -> list[float | None]

`completions[i]` is a string, or for a conversational prompt `[{"role": "assistant", "content": "..."}]`.
Every dataset column arrives by name with one value per completion (`answer=[...]`, ...);
`trainer_state` has `global_step` (steps done) and `max_steps`. Accept `**kwargs` to ignore
the rest: a signature that cannot take the arguments is a one-line error naming the argument
and the columns there are. A value of None means "does not apply to this completion".

Built-ins are plain per-completion functions (with doctests) made batched by `per_completion`:

| name | reward |
| --- | --- |
| `exact_match` | 1.0 if the completion, stripped, equals the answer as a string |
| `exact_integer` | the same, used by the built-in arithmetic task |
| `numeric_match` | 1.0 if the last number in the completion equals the numeric answer (1e-6 relative)* |
| `math_verify` | 1.0 if `math-verify` finds the completion's answer equivalent to the gold answer* |
| `format` | 1.0 if the completion matches `--format-pattern` (a regex, full match, DOTALL) |
| `length` | −(completion tokens / max_new_tokens), in [−1, 0]: a length penalty |
| `reasoning_gym` | a reasoning-gym task's own verifier on the reply's answer, by `--answer-from` (gspo.tasks.gym) |
| `answer_format` | 1.0 if the completion ends with one non-empty `<answer>...</answer>` |
| a model directory or hub id | a learned reward model's score, `logits[:, 0]` (gspo.rewards.model) |
| `judge:MODEL_OR_URL` | a language model's verdict on the completion, in [0, 1] (gspo.rewards.judge) |

*The gold answer is the part after the last `####` when there is one (GSM8K's worked solutions
end in `#### 72`); `exact_match` compares the whole answer. User rewards: `package.module:function`
or `path/to/file.py:function`. A learned reward: a directory whose config.json architectures end
in `ForSequenceClassification`, or a hub id such as `Skywork/Skywork-Reward-V2-Qwen3-0.6B`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.io.words import closest, did_you_mean, plural
from gspo.rewards.judge import Judge, JudgeOptions, is_judge
from gspo.rewards.model import RewardModel, check_device, reward_model_path
from gspo.tasks.scoring import RewardError, RewardFn, completion_text, per_completion

# ----------------------------------------------------------------------------------------------
# Built-in verifiers, one completion at a time
# ----------------------------------------------------------------------------------------------


def _exact(completion: str, answer: Any = None, **_) -> float:
    """1.0 when the stripped completion equals the stripped answer (compared as strings).

    >>> _exact(" Paris ", answer="Paris"), _exact("paris", answer="Paris"), _exact("7", answer=7)
    (1.0, 0.0, 1.0)
    """
    if answer is None:
        return 0.0
    gold = str(answer).strip()
    return 1.0 if gold != "" and completion.strip() == gold else 0.0


def exact_integer(completion: str, answer: Any = None, **_) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, spells the answer exactly.

    >>> exact_integer(" 415", "415"), exact_integer("4150", "415"), exact_integer("", "0")
    (1.0, 0.0, 0.0)
    """
    return _exact(completion, answer)


_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def gold_answer(answer: Any) -> Any:
    """The final answer of a worked solution: the text after the last `####` (GSM8K's
    convention), else the answer as it is.

    >>> gold_answer("48 / 2 = 24 clips in May.\\n48 + 24 = 72\\n#### 72"), gold_answer(7), gold_answer("1/2")
    ('72', 7, '1/2')
    """
    if isinstance(answer, str) and "####" in answer:
        return answer.rpartition("####")[2].strip()
    return answer


def _to_float(text: Any) -> float | None:
    try:
        return float(str(text).replace(",", "").strip())
    except ValueError:
        return None


def _numeric(completion: str, answer: Any = None, **_) -> float:
    """1.0 when the last number in the completion equals the answer (relative tolerance 1e-6);
    a worked solution's answer is the part after its last `####` (gold_answer).

    >>> _numeric("so the total is 1,250.", answer="1250"), _numeric("3.50", answer=3.5), _numeric("x", answer=1)
    (1.0, 1.0, 0.0)
    >>> _numeric("She sold 72 clips.", answer="48 + 24 = 72\\n#### 72"), _numeric("24", answer="... = 72\\n#### 72")
    (1.0, 0.0)
    """
    gold = _to_float(gold_answer(answer))
    found = _NUMBER.findall(completion)
    if gold is None or not found:
        return 0.0
    guess = _to_float(found[-1].rstrip("."))
    if guess is None:
        return 0.0
    return 1.0 if math.isclose(guess, gold, rel_tol=1e-6, abs_tol=1e-9) else 0.0


def _math_verify(completion: str, answer: Any = None, **_) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to the gold one (a
    worked solution's gold answer is the part after its last `####`, gold_answer).

    >>> _math_verify(r"so x = \\boxed{\\frac{1}{2}}", answer="0.5"), _math_verify("4", answer="5")
    (1.0, 0.0)
    >>> _math_verify(r"\\boxed{72}", answer="48 + 24 = 72\\n#### 72"), _math_verify(r"\\boxed{24}", answer="#### 72")
    (1.0, 0.0)
    """
    from math_verify import parse, verify

    answer = gold_answer(answer)
    if answer is None:
        return 0.0
    gold = parse(str(answer) if str(answer).startswith("$") else f"${answer}$")
    if not gold:
        gold = parse(str(answer))
    pred = parse(completion)
    return 1.0 if gold and pred and verify(gold, pred) else 0.0


DEFAULT_FORMAT_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_reward(pattern: str) -> RewardFn:
    """1.0 when the whole completion matches `pattern` (DOTALL), else 0.0.

    >>> f = format_reward(r"<answer>\\d+</answer>")
    >>> f(["<answer>12</answer>", "12"])
    [1.0, 0.0]
    """
    regex = re.compile(pattern, re.DOTALL)

    def _format(completion: str, **_) -> float:
        return 1.0 if regex.fullmatch(completion.strip()) else 0.0

    out = per_completion(_format)
    out.__name__ = "format"
    return out


def length_penalty(max_new_tokens: int) -> RewardFn:
    """−(completion tokens / max_new_tokens): 0 for an empty completion, −1 at the limit.

    >>> length_penalty(8)(["a", "b"], completion_ids=[[1, 2], [1, 2, 3, 4, 5, 6, 7, 8]])
    [-0.25, -1.0]
    """

    def length(completions: list, completion_ids: list | None = None, **_) -> list[float]:
        if completion_ids is None:  # character count as a stand-in
            return [-min(1.0, len(completion_text(c)) / max_new_tokens) for c in completions]
        return [-min(1.0, len(ids) / max_new_tokens) for ids in completion_ids]

    return length


exact_match = per_completion(_exact)
exact_match.__name__ = "exact_match"
numeric_match = per_completion(_numeric)
numeric_match.__name__ = "numeric_match"
math_verify = per_completion(_math_verify)
math_verify.__name__ = "math_verify"

BUILTIN_REWARDS = ("exact_match", "exact_integer", "numeric_match", "math_verify", "format", "length",
                   "reasoning_gym", "answer_format")  # the last two: reasoning-gym tasks' (gspo.tasks.gym)


# ----------------------------------------------------------------------------------------------
# Resolving names, weights, and applying rewards to a batch
# ----------------------------------------------------------------------------------------------


@dataclass
class Reward:
    name: str  # metric name: reward/<name>/mean
    fn: RewardFn
    weight: float = 1.0


def load_reward(spec, *, format_pattern: str = DEFAULT_FORMAT_PATTERN, max_new_tokens: int = 256,
                device=None, batch_size: int = 32, judge: JudgeOptions | None = None) -> Reward:
    """A reward by built-in name, `package.module:function`, `path/to/file.py:function`, a learned reward
    model (a directory or hub id on `device`, `batch_size` per forward), a judge (`judge:MODEL_OR_URL`,
    configured by `judge`), or a callable (the API's)."""
    if hasattr(spec, "config") and hasattr(spec, "forward"):  # a model object, as TRL takes: its tokenizer is unknown
        raise RewardError(f"reward {type(spec).__name__}: pass a reward model as its directory (save_pretrained)")
    if callable(spec):
        return Reward(getattr(spec, "__name__", type(spec).__name__), spec)
    if not isinstance(spec, str):
        raise RewardError(f"reward {spec!r}: expected a callable or a name, got {type(spec).__name__}")
    if spec in ("reasoning_gym", "answer_format"):
        from gspo.tasks.gym import REWARDS

        return Reward(spec, REWARDS[spec])
    if spec in BUILTIN_REWARDS:
        fn = {"exact_match": exact_match, "exact_integer": per_completion(exact_integer), "math_verify": math_verify,
              "numeric_match": numeric_match, "format": format_reward(format_pattern),
              "length": length_penalty(max_new_tokens)}[spec]
        if spec == "math_verify":
            try:
                import math_verify as _  # noqa: F401
            except ImportError:
                raise RewardError("reward 'math_verify' needs the math-verify package: "
                                  "pip install 'gspo[rewards]'") from None
        return Reward(spec, fn)
    if is_judge(spec):
        fn = Judge.load(spec, judge or JudgeOptions(), device=device, batch_size=batch_size)
        return Reward(fn.__name__, fn)
    if ":" not in spec:
        path = reward_model_path(spec)
        if path is None:
            best = closest(spec, BUILTIN_REWARDS)
            raise RewardError(f"unknown reward {spec!r}" + (f" (did you mean {best}?)" if best else "")
                              + f": expected a built-in ({', '.join(BUILTIN_REWARDS)}), "
                              "package.module:function, path/to/file.py:function, or a reward model (a directory "
                              "or a Hugging Face Hub id org/name)")
        rm = RewardModel.load(path, spec=spec, device=device or "cpu", batch_size=batch_size)
        return Reward(rm.__name__, rm)
    target, _, attr = spec.rpartition(":")
    module = _import(spec, target)
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        functions = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise RewardError(f"reward {spec!r}: {target} has no function {attr!r}"
                          + did_you_mean(attr, functions, lambda f: f"{target}:{f}"))
    return Reward(attr, fn)


def _import(spec: str, target: str):
    """The module of `package.module:function`, or of `path/to/file.py:function`."""
    if not (target.endswith(".py") or "/" in target or "\\" in target):
        try:
            return importlib.import_module(target)
        except Exception as e:
            raise RewardError(f"reward {spec!r}: cannot import module {target!r}: {type(e).__name__}: {e}") from None
    path = Path(target).expanduser()
    if not path.is_file():
        from gspo.io.hub import nearby

        hint = nearby(target, files=True)  # '; did you mean examples/rewards.py?', with the function
        if hint.startswith("; did you mean "):
            hint = f"{hint[:-1]}:{spec.rpartition(':')[2]}?"
        raise RewardError(f"reward {spec!r}: no such file {path}{hint}")
    mod_name = f"gspo_user_reward_{abs(hash(str(path.resolve())))}"
    module_spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[mod_name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's module failed to import
        raise RewardError(f"reward {spec!r}: importing {path} failed: {type(e).__name__}: {e}") from None
    return module


def load_rewards(specs: list[str], weights: list[float] | None, *, reward_model_device: str | None = None,
                 **kw) -> list[Reward]:
    """Every reward of `specs`, with its weight and a unique metric name. Learned reward models
    go on `reward_model_device` (checked here, used or not), else on `device` (the policy's)."""
    check_device(reward_model_device)  # a bad value is an error whether or not a reward model is used
    kw["device"] = reward_model_device or kw.get("device")
    if weights and len(weights) != len(specs):
        raise RewardError(f"reward_weights: {plural(len(weights), 'weight')} for {plural(len(specs), 'reward')}; "
                          "give one per --reward")
    rewards = [load_reward(s, **kw) for s in specs]
    names = [r.name for r in rewards]
    for i, r in enumerate(rewards):  # unique metric names
        if names.count(r.name) > 1:
            r.name = f"{r.name}_{i}"
        if weights:
            r.weight = float(weights[i])
    return rewards


@dataclass
class TrainerState:
    """TRL's `trainer_state` keyword, as far as gspo has it: for rewards that change with progress."""

    global_step: int = 0  # training steps completed (during step k: k - 1)
    max_steps: int = 0  # the run's --steps (0 outside a training run)
    # multi-turn episodes: each completion's environment, which rewards get as `environments=` (TRL's keyword)
    environments: list | None = field(default=None, repr=False)


def _caller(r: Reward, kwargs: dict[str, list], state: TrainerState) -> Callable[[list, dict], list]:
    """How `r` is called on (completions, per-completion kwargs): by keyword as TRL calls it, or
    completions first where its first parameter is named after nothing passed (`def f(comps, **kw)`)."""
    try:
        sig = inspect.signature(r.fn)
        sig.bind(completions=None, trainer_state=None, **kwargs)
    except ValueError:  # no signature to check (a builtin): call it as TRL does
        pass
    except TypeError as e:
        first = next(iter(sig.parameters.values()), None)
        positional = first is not None and first.kind in (first.POSITIONAL_ONLY, first.POSITIONAL_OR_KEYWORD)
        if positional and first.name not in {"completions", *kwargs}:
            try:
                sig.bind(None, trainer_state=None, **kwargs)
                return lambda completions, kw: r.fn(completions, trainer_state=state, **kw)
            except TypeError:
                pass
        columns = ", ".join(k for k in kwargs if k not in ("prompts", "completion_ids")) or "none"
        raise RewardError(f"reward {r.name!r} cannot be called with the arguments rewards get: {e} (rewards get "
                          f"prompts, completions, completion_ids, trainer_state and the dataset columns {columns}; "
                          "take the ones it does not use with **kwargs)") from None
    return lambda completions, kw: r.fn(completions=completions, trainer_state=state, **kw)


def _failing_row(call, completions: list, kwargs: dict[str, list], sources: list[str]) -> str:
    """Call the reward one completion at a time to find the row that makes it raise."""
    for i in range(len(completions)):
        try:
            call(completions[i:i + 1], {k: v[i:i + 1] for k, v in kwargs.items()})
        except Exception:
            return sources[i]
    return f"a batch of {sources[0]} ... {sources[-1]} (no single row raises alone)"


def apply_rewards(rewards: list[Reward], completions: list, kwargs: dict[str, list], sources: list[str],
                  trainer_state: TrainerState | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """Run every reward over the batch (`kwargs`: one value per completion each, passed by
    keyword, _caller); returns (weighted total per completion, per-reward values). None (TRL's
    "does not apply") is left out of the weighted sum and recorded as NaN. A RewardError names
    the reward and the row when it raises, returns the wrong number of values, or a value that is
    not a finite number or None (a bool or a string too); the argument when its signature does not fit.
    A reward that keeps `last_metrics` (a judge's: name -> one value per completion of its last call)
    adds them to the per-reward values as `<reward>/<name>`, outside the sum (logged under that name).
    """
    n, state = len(completions), trainer_state or TrainerState()
    per: dict[str, list[float]] = {}
    for r in rewards:
        call = _caller(r, kwargs, state)
        try:
            values = call(completions, kwargs)
        except RewardError:
            raise
        except Exception as e:
            raise RewardError(f"reward {r.name!r} raised {type(e).__name__}: {e} on "
                              f"{_failing_row(call, completions, kwargs, sources)}") from None
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = plural(len(values), "value") if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardError(f"reward {r.name!r} returned {got} for {plural(n, 'completion')}; "
                              f"expected a list of {plural(n, 'float')}")
        per[r.name] = [_value(v, r.name, sources[i]) for i, v in enumerate(values)]
        per.update({f"{r.name}/{k}": v for k, v in (getattr(r.fn, "last_metrics", None) or {}).items()})
    # None (NaN here): the reward does not apply to this completion; it adds nothing to the sum
    total = [sum(r.weight * per[r.name][i] for r in rewards if per[r.name][i] == per[r.name][i]) for i in range(n)]
    return total, per


def _value(v, name: str, source: str) -> float:
    """A reward's value as a float; None (TRL's "does not apply") becomes NaN."""
    if v is None:
        return float("nan")
    if isinstance(v, (bool, str, bytes)) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise RewardError(f"reward {name!r} returned {v!r} ({type(v).__name__}) for {source}; expected a number "
                          "(or None where the reward does not apply)")
    f = float(v)
    if not math.isfinite(f):
        raise RewardError(f"reward {name!r} returned {f} for {source}; expected a finite number (or None)")
    return f


def score_completions(rewards: list[Reward], examples: list, completions: list[str], completion_ids: list[list[int]],
                      group_size: int, trainer_state: TrainerState | None = None) -> tuple[list[float], dict]:
    """Score completion b of example b // group_size with every reward (the TRL calling convention).

    Conversational examples get their completions as `[{"role": "assistant", "content": text}]`; each keyword
    holds one value per completion (`prompts`, `completion_ids`, `answer`, every column, and with
    multi-turn episodes `environments`, each episode's environment, as TRL passes them: the
    trainer state's); `trainer_state` one.
    """
    rows = [examples[b // group_size] for b in range(len(completions))]
    comps = [[{"role": "assistant", "content": c}] if ex.is_chat else c for c, ex in zip(completions, rows)]
    keys = dict.fromkeys(k for ex in examples for k in ex.columns)
    kwargs = {k: [ex.columns.get(k) for ex in rows] for k in keys}
    kwargs["answer"] = [ex.answer for ex in rows]
    kwargs["prompts"] = [ex.prompt for ex in rows]
    kwargs["completion_ids"] = completion_ids
    if trainer_state is not None and trainer_state.environments is not None:
        kwargs["environments"] = trainer_state.environments
    return apply_rewards(rewards, comps, kwargs, [ex.source for ex in rows], trainer_state)
