"""reasoning-gym's procedural tasks by name: `--task reasoning_gym:NAME` (106 generators:
basic_arithmetic, chain_sum, gsm_symbolic, countdown, leg_counting, ...).

    task = GymTask.from_spec("reasoning_gym:basic_arithmetic", {"max_terms": 3}, test_size=200)
    task = GymTask.from_spec("reasoning_gym:chain_sum=2,leg_counting=1", {"chain_sum.max_terms": 3})

A spec names one generator, or several with weights (`a=2,b=1`; no weight means 1) mixed as
reasoning-gym's CompositeDataset mixes them: each problem comes from one generator drawn by
weight. Options are the generator's config fields (`reasoning_gym.create_dataset(name,
**options)`); in a mix, `NAME.KEY` sets one generator's and a bare `KEY` every generator that
has it. `size` and `seed` are gspo's: the splits below set them.

Splits. The held-out set is the first `test_size` distinct questions of a generator seeded from
`split_seed` alone, the same for every run and every training seed. Training problems come in
blocks of 256 from generators seeded by (split_seed, run seed, block): problem j of a run is
item j % 256 of block j // 256, a function of (seed, j) alone, so a resumed run sees the prompts
an uninterrupted one would. A training problem whose question is a held-out one is replaced by
the same item of a reserve block, so the two never overlap.

Prompts are the generator's question, as the user's turn; the default system prompt
(SYSTEM_PROMPT) asks for the final answer inside <answer>...</answer>, as reasoning-gym's own
prompts do. Rewards (below): `reasoning_gym`, the generator's own `score_answer` (partial
credit kept) on the answer `extract_answer` finds by the --answer-from rule (default: the text
inside the last <answer>...</answer>, else the reply's last line), and `answer_format`, 1.0 when
the completion ends with one non-empty <answer>...</answer>.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass, field

from gspo.tasks.data import Example

PREFIX = "reasoning_gym:"
BLOCK = 256  # training problems per seeded generator
SYSTEM_PROMPT = ("Solve the problem. Give your final answer inside <answer> </answer> tags, for example "
                 "<answer>42</answer>, with nothing but the answer inside them.")
# the default system prompt for each --answer-from rule
SYSTEM_PROMPTS = {"tag": SYSTEM_PROMPT, "tag_only": SYSTEM_PROMPT,
                  "last_line": "Solve the problem. End your reply with the final answer alone on its last line.",
                  "last_number": "Solve the problem. End your reply with the final answer as a number."}
RESERVED = ("size", "seed")


class TaskError(ValueError):
    """A reasoning-gym task that cannot be built; the message is one line."""


def is_gym(name: str | None) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def gym():
    """The reasoning_gym package, or one line saying how to install it."""
    try:
        import reasoning_gym
    except ImportError:
        raise TaskError("--task reasoning_gym:...: needs the reasoning-gym package: pip install 'gspo[tasks]' "
                        "(or pip install reasoning-gym)") from None
    return reasoning_gym


def names() -> list[str]:
    """Every generator reasoning-gym registers, sorted."""
    gym()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def parse_spec(spec: str) -> list[tuple[str, float]]:
    """`reasoning_gym:a=2,b` -> [("a", 2.0), ("b", 1.0)], each name checked (one line with a
    did-you-mean when it is not a generator).

    >>> parse_spec("reasoning_gym:chain_sum=2,leg_counting")
    [('chain_sum', 2.0), ('leg_counting', 1.0)]
    """
    from gspo.io.words import did_you_mean

    body = spec[len(PREFIX):] if is_gym(spec) else spec
    out = []
    for part in filter(None, (p.strip() for p in body.split(","))):
        name, eq, weight = part.partition("=")
        try:
            w = float(weight) if eq else 1.0
        except ValueError:
            raise TaskError(f"--task {spec}: weight {weight!r} of {name} is not a number") from None
        if not w > 0:
            raise TaskError(f"--task {spec}: weight of {name} must be > 0 (got {weight})")
        out.append((name.strip(), w))
    if not out:
        raise TaskError(f"--task {spec}: no generator named; e.g. --task reasoning_gym:basic_arithmetic "
                        "(gspo tasks lists them)")
    known = names()
    for name, _ in out:
        if name not in known:
            raise TaskError(f"--task {spec}: reasoning-gym has no task {name!r}" + did_you_mean(name, known)
                            + f" ({len(known)} tasks: gspo tasks lists them)")
    if len({n for n, _ in out}) < len(out):
        raise TaskError(f"--task {spec}: a task is named twice")
    return out


def config_fields(name: str) -> dict:
    """A generator's options and their defaults (its config dataclass), `size` and `seed` left out."""
    import dataclasses

    from reasoning_gym.factory import DATASETS

    cls = DATASETS[name][1]
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in RESERVED:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        out[f.name] = default
    return out


def split_options(spec: str, mix: list[tuple[str, float]], options: dict) -> dict[str, dict]:
    """Options per generator: `NAME.KEY` for one, a bare `KEY` for every one that has it."""
    from gspo.io.words import did_you_mean

    per = {name: {} for name, _ in mix}
    for key, value in options.items():
        target, dot, field_name = key.rpartition(".")
        if dot and target not in per:
            raise TaskError(f"--task-option {key}: {target!r} is not a task of {spec}")
        if field_name in RESERVED:
            raise TaskError(f"--task-option {key}: {field_name} is set by gspo (the splits' seeds and sizes); "
                            "use --seed and --eval-size")
        owners = [target] if dot else [n for n in per if field_name in config_fields(n)]
        if not owners or field_name not in config_fields(owners[0]):
            valid = sorted({f for n in ([target] if dot else per) for f in config_fields(n)})
            raise TaskError(f"--task-option {key}: not an option of {target or spec}"
                            + did_you_mean(field_name, valid) + f" (options: {', '.join(valid)})")
        for n in owners:
            per[n][field_name] = value
    return per


def parse_options(options: tuple[str, ...]) -> dict:
    """("max_terms=3", "operators=[+, -]") -> {"max_terms": 3, "operators": ["+", "-"]} (values
    read as YAML scalars); one line for an entry without `=`.

    >>> parse_options(("max_terms=3", "allow_negation=false", "chain_sum.format_style=simple"))
    {'max_terms': 3, 'allow_negation': False, 'chain_sum.format_style': 'simple'}
    """
    import yaml

    out = {}
    for item in options:
        key, eq, value = str(item).partition("=")
        if not eq or not key.strip():
            raise TaskError(f"--task-option {item!r}: expected KEY=VALUE (e.g. max_terms=3)")
        try:
            out[key.strip()] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def _seed(*parts) -> int:
    """A 31-bit seed from its parts (stable across runs and Python versions)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "big") >> 1


@dataclass
class GymTask:
    """A reasoning-gym generator (or a weighted mix) as a gspo task: fixed held-out problems,
    training problems drawn by (seed, step)."""

    mix: list[tuple[str, float]]
    options: dict[str, dict]  # per generator
    test_size: int = 500
    split_seed: int = 0
    name: str = "reasoning_gym"
    default_rewards: tuple[str, ...] = ("reasoning_gym",)
    default_max_new_tokens: int = 256
    default_system_prompt: str = SYSTEM_PROMPT
    answer_from: str = "tag"  # what the verifier scores (extract_answer): tag, tag_only, last_line or last_number
    notes: list[str] = field(default_factory=list)
    # (seed, block, reserve) -> problems
    _blocks: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def from_spec(cls, spec: str, options: dict | None = None, *, test_size: int = 500, split_seed: int = 0,
                  answer_from: str = "tag"):
        mix = parse_spec(spec)
        per = split_options(spec, mix, dict(options or {}))
        task = cls(mix, per, test_size=test_size, split_seed=split_seed, name=spec,
                   default_system_prompt=SYSTEM_PROMPTS[answer_from], answer_from=answer_from)
        task._generator(("check",), 1)  # a bad option value fails here, in one line
        task._test = task._draw_test()
        return task

    def _generator(self, key: tuple, size: int):
        """A reasoning-gym dataset of `size` items seeded by `key` (the mix, when several)."""
        rg = gym()
        seed = _seed(self.split_seed, *key)
        try:
            if len(self.mix) == 1:
                name = self.mix[0][0]
                return rg.create_dataset(name, size=size, seed=seed, **self.options[name])
            from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

            specs = [DatasetSpec(n, w, dict(self.options[n])) for n, w in self.mix]
            return CompositeDataset(CompositeConfig(size=size, seed=seed, datasets=specs))
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            single = len(self.mix) == 1
            given = ", ".join(f"{k if single else n + '.' + k}={v!r}"
                              for n, o in self.options.items() for k, v in o.items())
            raise TaskError(f"--task {self.name}: {'options ' + given if given else 'the default options'} "
                            "refused by reasoning-gym "
                            f"({type(e).__name__}: {' '.join(str(e).split())[:160] or 'a check failed'})") from None

    def _draw_test(self) -> list[Example]:
        out, seen = [], set()
        self._test_questions = seen
        if self.test_size == 0:  # --eval-size 0: nothing is evaluated (reasoning-gym refuses a dataset of size 0)
            return out
        ds = self._generator(("test",), 4 * self.test_size)
        for i in range(len(ds)):
            if len(out) == self.test_size:
                break
            entry = ds[i]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(self._example(entry, f"{self.name} test problem {len(out) + 1}"))
        if len(out) < self.test_size:
            self.notes.append(f"task {self.name}: only {len(out)} distinct held-out problems in "
                              f"{4 * self.test_size} draws (asked for {self.test_size})")
        return out

    def _block(self, seed: int, block: int, reserve: int):
        """Block `block` of training problems; the last 8 kept."""
        key = (seed, block, reserve)
        if key not in self._blocks:
            if len(self._blocks) >= 8:
                self._blocks.pop(next(iter(self._blocks)))  # the oldest
            self._blocks[key] = self._generator(("train", *key), BLOCK)
        return self._blocks[key]

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        """Problems (step-1)·n ... step·n-1 of the run's stream: a function of (seed, step) only."""
        out = []
        for j in range((step - 1) * n, step * n):
            block, i = divmod(j, BLOCK)
            for reserve in range(100):
                entry = self._block(seed, block, reserve)[i]
                if entry["question"] not in self._test_questions:
                    break
            else:
                raise TaskError(f"--task {self.name}: training problem {j + 1} repeats a held-out one 100 times; "
                                "the task has too few distinct problems for --eval-size")
            out.append(self._example(entry, f"{self.name} step {step} problem {len(out) + 1}"))
        return out

    def test_set(self, n: int | None = None) -> list[Example]:
        return self._test[: n or len(self._test)]

    def _example(self, entry: dict, source: str) -> Example:
        name = entry.get("metadata", {}).get("source_dataset", self.mix[0][0])
        options = json.dumps(self.options.get(name, {}), sort_keys=True, default=str)
        return Example(prompt=entry["question"], answer=entry["answer"], source=source,
                       columns={"entry": entry, "task_options": options, "answer_from": self.answer_from})

    __hash__ = object.__hash__


# ----------------------------------------------------------------------------------------------
# Rewards: the generator's own verifier, and the answer format
# ----------------------------------------------------------------------------------------------

_ANSWER = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_FORMAT = re.compile(r".*<answer>\s*\S.*?</answer>\s*", re.DOTALL)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def extract_answer(text: str, rule: str = "tag") -> str | None:
    """The answer a completion gives, by `rule` (--answer-from); None when it gives none.
    tag: the text inside the last <answer>...</answer>, stripped, and for a reply without the
    tags its last non-empty line (a model that never writes them still gets its answer scored,
    with the verifier's partial credit for a line that holds more than the answer); tag_only: the
    tags or nothing (reasoning-gym's own extract_answer); last_line: the last non-empty line,
    stripped; last_number: the last number, its thousands commas dropped.

    >>> extract_answer("5 + 7 = 12, so <answer> 12 </answer>"), extract_answer("so 12", "tag_only")
    ('12', None)
    >>> extract_answer("7 + 5 = 12.\\n"), extract_answer("so it is\\n  1,234 \\n", "last_line")
    ('7 + 5 = 12.', '1,234')
    >>> extract_answer("7 + 5 = 12.", "last_number")
    '12'
    """
    if rule == "last_number":
        found = _NUMBER.findall(text)
        return found[-1].replace(",", "") if found else None
    if rule != "last_line":
        found = _ANSWER.findall(text)
        if found or rule == "tag_only":
            return found[-1].strip() if found else None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else None


@functools.lru_cache(maxsize=64)
def _scorer(name: str, options: str):
    """The generator `name`'s score_answer, as configured by the task (`options`: JSON)."""
    return gym().create_dataset(name, size=1, seed=0, **json.loads(options)).score_answer


def reasoning_gym_reward(completions: list, entry: list, task_options: list | None = None,
                         answer_from: list | None = None, **_) -> list[float]:
    """reasoning-gym's `score_answer(answer, entry)` of each completion's answer (extract_answer by
    the task's --answer-from rule), in [0, 1] with the generator's partial credit; 0.0 where the
    verifier raises on what the model wrote."""
    from gspo.tasks.scoring import completion_text

    out = []
    for i, (completion, e) in enumerate(zip(completions, entry)):
        name = e["metadata"]["source_dataset"]
        score_answer = _scorer(name, task_options[i] if task_options else "{}")
        answer = extract_answer(completion_text(completion), answer_from[i] if answer_from else "tag")
        try:
            out.append(float(score_answer(answer, e)))
        except Exception:  # the verifier choked on the model's text: a wrong answer
            out.append(0.0)
    return out


def answer_format(completions: list, **_) -> list[float]:
    """1.0 when the completion ends with one non-empty <answer>...</answer> (nothing after it).

    >>> answer_format(["so <answer>12</answer>", "<answer></answer>", "<answer>1</answer> and more"])
    [1.0, 0.0, 0.0]
    """
    from gspo.tasks.scoring import completion_text

    return [1.0 if _FORMAT.fullmatch(t) and len(_ANSWER.findall(t)) == 1 else 0.0
            for t in map(completion_text, completions)]


reasoning_gym_reward.__name__ = "reasoning_gym"
REWARDS = {"reasoning_gym": reasoning_gym_reward, "answer_format": answer_format}
