"""Your own data: prompts (and reference answers) from files or the Hugging Face Hub, validated row by row.

    from gspo.tasks.data import load_dataset_task
    from gspo.config import Data
    task = load_dataset_task("train.jsonl", Data(prompt_column="question", answer_column="solution"))
    task = load_dataset_task("openai/gsm8k", Data(dataset_config="main", prompt_column="question", eval_split="test"))

Formats, chosen by the path:

| path | read with |
| --- | --- |
| `ORG/NAME`, a Hub dataset id (not a local path) | `datasets.load_dataset(id, config)` (gspo.io.hub; `--dataset-config`, `--dataset-split`, `--eval-split`) |
| `*.jsonl`, `*.ndjson` | one JSON object per line |
| `*.json` | a JSON list of objects |
| `*.csv`, `*.tsv` | a header row, then one row per example |
| `*.parquet` | pyarrow |
| a directory written by `datasets`' `save_to_disk` | `datasets.load_from_disk` (pick a split of a DatasetDict with `--dataset-split`) |
| any other directory | `datasets.load_dataset(dir, split=...)` (data files in the folder) |

Each row needs the prompt column: a non-empty string, or a non-empty list of chat messages
(`{"role": ..., "content": ...}`), which gets the tokenizer's chat template. The answer
column is optional unless a reward compares to it; when present it must be a string or a
number. Every column travels with its row and reaches reward functions as a keyword
argument. Problems are reported as one line naming the file, the line or row, and the field:

    train.jsonl line 17: field 'prompt' must be a non-empty string or a list of chat messages, got int
    openai/gsm8k[main] train row 17: field 'answer' must be a string or a number, got list

Evaluation rows: `--eval-dataset`, or `--eval-split` of a dataset directory, Hub dataset or
in-memory `datasets.DatasetDict`, or else a fixed held-out slice of the training data (the
smaller of `eval_size` and a tenth of it), never trained on. `--dataset-config` applies to
both Hub ids (`--dataset` and `--eval-dataset`).
"""  # noqa: E501 (the formats table above: a row is as long as its path and reader need)

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gspo.config import Data


class DataError(ValueError):
    """Bad input data; the message is one line naming the file, row and field."""


@dataclass
class Example:
    """One prompt and what the rewards need to score completions of it."""

    prompt: str | list[dict]  # text, or chat messages
    answer: Any  # the reference answer, or None
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, by name
    source: str = ""  # where it came from, for messages: "train.jsonl line 17"

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)

    def row(self) -> dict[str, Any]:
        """The dataset row as an environment's reset(**row) gets it: `prompt`, every other column,
        and `answer` (unless None or a column already holds one)."""
        row = {"prompt": self.prompt, **self.columns}
        if self.answer is not None:
            row.setdefault("answer", self.answer)
        return row


# ----------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------


def _read_jsonl(path: Path):
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path} line {n}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path} line {n}: expected a JSON object, got {type(row).__name__}")
            yield f"{path} line {n}", row


def _read_json(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} line {e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of objects, got {type(data).__name__}"
                        " (one object per line? name the file .jsonl)")
    for n, row in enumerate(data, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} item {n}: expected a JSON object, got {type(row).__name__}")
        yield f"{path} item {n}", row


def _read_csv(path: Path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
        for n, row in enumerate(reader, 1):
            if None in row:
                raise DataError(f"{path} row {n}: more fields than the header has columns")
            yield f"{path} row {n}", row


def _read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install 'gspo[data]'") from None
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:
        raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
    for n, row in enumerate(rows, 1):
        yield f"{path} row {n}", row


def _read_hf_dir(path: Path, split: str | None):
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a dataset directory needs the datasets library: "
                        "pip install 'gspo[data]'") from None
    datasets.disable_progress_bars()
    saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    try:
        ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a readable dataset directory "
                        f"({type(e).__name__}: {' '.join(str(e).split())})") from None
    if isinstance(ds, (datasets.DatasetDict, dict)):
        ds = _split_of(ds, split, str(path))
    for n, row in enumerate(ds, 1):
        yield f"{path} row {n}", dict(row)


DATA_SUFFIXES = (".jsonl", ".ndjson", ".json", ".csv", ".tsv", ".parquet")


def is_hub_dataset(path) -> bool:
    """A Hub dataset id: `ORG/NAME`, not an existing local path, not a data file's name."""
    from gspo.io.hub import looks_like_hub_id

    return isinstance(path, str) and "/" in path and looks_like_hub_id(path) and not path.endswith(DATA_SUFFIXES)


def hub_name(repo_id: str, config: str | None) -> str:
    """How rows of a Hub dataset are named in messages: `openai/gsm8k[main]`."""
    return f"{repo_id}[{config}]" if config else repo_id


def _read_hub(repo_id: str, config: str | None, split: str | None):
    from gspo.io.hub import load_dataset_dict

    ds = _split_of(load_dataset_dict(repo_id, config), split, hub_name(repo_id, config))
    for n, row in enumerate(ds, 1):
        yield f"{hub_name(repo_id, config)} {split} row {n}", dict(row)


def _split_of(splits, split: str | None, name: str):
    """One split of a DatasetDict, or a one-line error listing its splits."""
    if split is None or split not in splits:
        raise DataError(f"{name}: no split {split!r} (splits: {', '.join(splits.keys())}); choose one with "
                        "--dataset-split / --eval-split")
    return splits[split]


def read_records(path: str | Path, split: str | None = None, config: str | None = None) -> list[tuple[str, dict]]:
    """(source, row) pairs from a file, a dataset directory or a Hub dataset id (its `config`)."""
    if is_hub_dataset(path):
        out = list(_read_hub(path, config, split))
        if not out:
            raise DataError(f"{hub_name(path, config)} {split}: no rows")
        return out
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"{path}: no such file or directory")
    if path.is_dir():
        records = _read_hf_dir(path, split)
    elif path.suffix in (".jsonl", ".ndjson"):
        records = _read_jsonl(path)
    elif path.suffix == ".json":
        records = _read_json(path)
    elif path.suffix in (".csv", ".tsv"):
        records = _read_csv(path)
    elif path.suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise DataError(f"{path}: unsupported file type {path.suffix!r}; expected .jsonl, .json, .csv, .tsv, "
                        ".parquet or a datasets directory")
    try:
        out = list(records)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not out:
        raise DataError(f"{path}: no rows")
    return out


# ----------------------------------------------------------------------------------------------
# Validating rows into Examples
# ----------------------------------------------------------------------------------------------


def _check_prompt(value, source: str, column: str):
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{source}: field {column!r} is empty; "
                            "expected a non-empty string or a list of chat messages")
        return value
    if isinstance(value, list) and value:
        for m in value:
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{source}: field {column!r} is a list but not of chat messages; "
                                "expected {\"role\": str, \"content\": str} objects")
        return value
    got = "an empty list" if isinstance(value, list) else type(value).__name__
    raise DataError(f"{source}: field {column!r} must be a non-empty string or a list of chat messages, got {got}")


def _check_answer(value, source: str, column: str):
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{source}: field {column!r} must be a string or a number, got {type(value).__name__}")
    return value


def to_examples(records: list[tuple[str, dict]], path, *, prompt_column: str, answer_column: str,
                require_answer: bool) -> list[Example]:
    first_source, first = records[0]
    if prompt_column not in first:
        raise DataError(f"{path}: no column {prompt_column!r} (columns: {', '.join(map(str, first))}); "
                        "set --prompt-column")
    has_answer = answer_column in first
    if require_answer and not has_answer:
        raise DataError(f"{path}: no column {answer_column!r} (columns: {', '.join(map(str, first))}), which the "
                        "rewards compare completions to; set --answer-column")
    out = []
    for source, row in records:
        if prompt_column not in row:
            raise DataError(f"{source}: missing field {prompt_column!r}")
        prompt = _check_prompt(row[prompt_column], source, prompt_column)
        answer = None
        if has_answer:
            if answer_column not in row:
                raise DataError(f"{source}: missing field {answer_column!r}")
            answer = _check_answer(row[answer_column], source, answer_column)
        columns = {k: v for k, v in row.items() if k != prompt_column}
        out.append(Example(prompt, answer, columns, source))
    return out


# ----------------------------------------------------------------------------------------------
# A task over a dataset
# ----------------------------------------------------------------------------------------------


@dataclass
class DatasetTask:
    """Training rows in a seeded order, epoch after epoch; a fixed list of evaluation rows."""

    train: list[Example]
    eval: list[Example]
    name: str = "dataset"
    default_rewards: tuple[str, ...] = ("exact_match",)
    default_max_new_tokens: int = 256
    notes: list[str] = field(default_factory=list)  # warnings for the user (e.g. a tiny evaluation split)
    _orders: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (seed, epoch) -> order

    def _order(self, seed: int, epoch: int) -> tuple[int, ...]:
        """Epoch `epoch`'s shuffle; the last 4 kept (a batch spans at most two epochs)."""
        if (seed, epoch) not in self._orders:
            idx = list(range(len(self.train)))
            random.Random(f"dataset-{seed}-{epoch}").shuffle(idx)
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))  # the oldest
            self._orders[(seed, epoch)] = tuple(idx)
        return self._orders[(seed, epoch)]

    def train_batch(self, step: int, n: int, seed: int = 0) -> list[Example]:
        """Rows for training step `step` (1-based): positions (step-1)·n ... step·n-1 of the
        concatenation of per-epoch shuffles; a function of (seed, step) alone."""
        N = len(self.train)
        out = []
        for j in range((step - 1) * n, step * n):
            epoch, pos = divmod(j, N)
            out.append(self.train[self._order(seed, epoch)[pos]])
        return out

    def test_set(self, n: int | None = None) -> list[Example]:
        return self.eval[: n or len(self.eval)]

    __hash__ = object.__hash__


def rows_of(data, name: str) -> list[tuple[str, dict]]:
    """(source, row) pairs of in-memory data: a list of dicts or a `datasets.Dataset`."""
    if hasattr(data, "column_names") and hasattr(data, "__iter__") and not isinstance(data, dict):  # datasets.Dataset
        rows = [dict(r) for r in data]
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        raise DataError(f"{name}: expected a list of dicts, a datasets.Dataset or DatasetDict, "
                        f"got {type(data).__name__}")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{name} row {n}: expected a dict, got {type(row).__name__}")
    if not rows:
        raise DataError(f"{name}: no rows")
    return [(f"{name} row {n}", row) for n, row in enumerate(rows, 1)]


def _is_dataset_dict(data) -> bool:
    """A `datasets.DatasetDict` (a dict of splits), without importing datasets."""
    return isinstance(data, dict) and bool(data) and all(hasattr(v, "column_names") for v in data.values())


def has_splits(data) -> bool:
    """Whether `data` has named splits: an in-memory DatasetDict, a Hub dataset id or a dataset directory."""
    if not isinstance(data, (str, Path)):
        return _is_dataset_dict(data)
    return is_hub_dataset(data) or Path(data).expanduser().is_dir()


def _name(data, config: str | None, in_memory: str) -> str:
    if not isinstance(data, (str, Path)):
        return in_memory
    return hub_name(data, config) if is_hub_dataset(data) else str(data)


def _records(data, split: str, config: str | None, name: str) -> list[tuple[str, dict]]:
    """(source, row) pairs of `data` (in memory, a Hub id, a directory or a file); `split` where it has splits."""
    if not isinstance(data, (str, Path)):
        if _is_dataset_dict(data):
            return rows_of(_split_of(data, split, name), f"{name}[{split}]")
        return rows_of(data, name)
    return read_records(data, split if has_splits(data) else None, config)


def load_dataset_task(path, data: Data | None = None, *, eval_path=None, eval_size: int = 500,
                      require_answer: bool = True) -> DatasetTask:
    """Read, validate and split a dataset; raises DataError on the first bad row.

    path / eval_path: a file, a dataset directory, a Hub dataset id (with `data.dataset_config`),
    or in-memory rows (a list of dicts, a datasets.Dataset, or a DatasetDict whose
    `data.dataset_split` / `data.eval_split` are used). data (gspo.config.sections.Data, default Data()):
    the columns, splits and Hub config; its `dataset` and `eval_dataset` are not read (`path`,
    `eval_path` are). eval_size: the most rows held out for evaluation when there is no eval_path
    or eval_split. require_answer: every row needs the answer column."""
    data = data or Data()
    split, eval_split, config = data.dataset_split, data.eval_split, data.dataset_config
    kw = dict(prompt_column=data.prompt_column, answer_column=data.answer_column, require_answer=require_answer)
    notes: list[str] = []  # warnings, said once the run starts (not before an error)
    name = _name(path, config, "train_dataset")
    train = to_examples(_records(path, split, config, name), name, **kw)
    if eval_path is not None:
        eval_name = _name(eval_path, config, "eval_dataset")
        evals = to_examples(_records(eval_path, eval_split or split, config, eval_name), eval_name, **kw)
    elif eval_split is not None:
        if not has_splits(path):
            raise DataError(f"{name}: --eval-split needs data with splits (a dataset directory, a Hub dataset or a "
                            "DatasetDict); give --eval-dataset FILE instead")
        evals = to_examples(_records(path, eval_split, config, name), name, **kw)
    else:
        if len(train) < 2:
            raise DataError(f"{name}: only {len(train)} row; need at least 2 to hold one out for evaluation, "
                            "or give --eval-dataset")
        held = min(eval_size, max(1, len(train) // 10))  # 0 with --eval-size 0: nothing held out
        if 0 < held < 10:
            notes.append(f"{name}: evaluating on {held} held-out row(s) of {len(train)} (a tenth of the data): the "
                         f"accuracy moves in steps of {100 / held:.0f} points; "
                         "give --eval-dataset for a real evaluation")
        order = list(range(len(train)))
        random.Random("gspo-holdout").shuffle(order)
        evals = [train[i] for i in sorted(order[:held])]
        keep = set(order[held:])
        train = [ex for i, ex in enumerate(train) if i in keep]
    short = name if not isinstance(path, (str, Path)) or is_hub_dataset(path) else Path(path).name
    return DatasetTask(train, evals, name=short, notes=notes)
