"""Your own data: prompts (and reference answers) from files, validated row by row.

    from gspo.data import load_dataset_task
    task = load_dataset_task("train.jsonl", prompt_column="question", answer_column="solution")

Formats, chosen by the path:

| path | read with |
| --- | --- |
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

Evaluation rows: `--eval-dataset`, or `--eval-split` of a dataset directory, or else a fixed
held-out slice of the training file (the smaller of `eval_size` and a tenth of it), never
trained on.
"""

from __future__ import annotations

import csv
import functools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


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
        raise DataError(f"{path}: reading a dataset directory needs the datasets library: pip install 'gspo[data]'") from None
    datasets.disable_progress_bars()
    saved = (path / "dataset_dict.json").exists() or (path / "state.json").exists()
    try:
        ds = datasets.load_from_disk(str(path)) if saved else datasets.load_dataset(str(path))
    except Exception as e:
        raise DataError(f"{path}: not a readable dataset directory ({type(e).__name__}: {' '.join(str(e).split())})") from None
    if isinstance(ds, (datasets.DatasetDict, dict)):
        if split is None or split not in ds:
            splits = ", ".join(ds.keys())
            raise DataError(f"{path}: no split {split!r} (splits: {splits}); choose one with --dataset-split / --eval-split")
        ds = ds[split]
    for n, row in enumerate(ds, 1):
        yield f"{path} row {n}", dict(row)


def read_records(path: str | Path, split: str | None = None) -> list[tuple[str, dict]]:
    """(source, row) pairs from a file or dataset directory."""
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
            raise DataError(f"{source}: field {column!r} is empty; expected a non-empty string or a list of chat messages")
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

    @functools.lru_cache(maxsize=4)
    def _order(self, seed: int, epoch: int) -> tuple[int, ...]:
        idx = list(range(len(self.train)))
        random.Random(f"dataset-{seed}-{epoch}").shuffle(idx)
        return tuple(idx)

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
    if hasattr(data, "column_names") and hasattr(data, "__iter__"):  # datasets.Dataset
        rows = [dict(r) for r in data]
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        raise DataError(f"{name}: expected a list of dicts or a datasets.Dataset, got {type(data).__name__}")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{name} row {n}: expected a dict, got {type(row).__name__}")
    if not rows:
        raise DataError(f"{name}: no rows")
    return [(f"{name} row {n}", row) for n, row in enumerate(rows, 1)]


def load_dataset_task(path: str, *, prompt_column: str = "prompt", answer_column: str = "answer",
                      split: str = "train", eval_path: str | None = None, eval_split: str | None = None,
                      eval_size: int = 500, require_answer: bool = True) -> DatasetTask:
    """Read, validate and split a dataset; raises DataError on the first bad row."""
    kw = dict(prompt_column=prompt_column, answer_column=answer_column, require_answer=require_answer)
    notes: list[str] = []  # warnings, said once the run starts (not before an error)
    in_memory = not isinstance(path, (str, Path))  # the Python API's train_dataset= / eval_dataset=
    is_dir = not in_memory and Path(path).expanduser().is_dir()
    name = "train_dataset" if in_memory else path
    records = rows_of(path, name) if in_memory else read_records(path, split if is_dir else None)
    train = to_examples(records, name, **kw)
    if eval_path is not None and not isinstance(eval_path, (str, Path)):
        evals = to_examples(rows_of(eval_path, "eval_dataset"), "eval_dataset", **kw)
    elif eval_path is not None:
        eval_dir = Path(eval_path).expanduser().is_dir()
        evals = to_examples(read_records(eval_path, (eval_split or split) if eval_dir else None), eval_path, **kw)
    elif eval_split is not None:
        if not is_dir:
            raise DataError(f"{path}: --eval-split needs a dataset directory with splits; give --eval-dataset FILE instead")
        evals = to_examples(read_records(path, eval_split), path, **kw)
    else:
        if len(train) < 2:
            raise DataError(f"{name}: only {len(train)} row; need at least 2 to hold one out for evaluation, or give --eval-dataset")
        held = min(eval_size, max(1, len(train) // 10))
        if held < 10:
            notes.append(f"{name}: evaluating on {held} held-out row(s) of {len(train)} (a tenth of the data): the "
                         f"accuracy moves in steps of {100 / held:.0f} points; give --eval-dataset for a real evaluation")
        order = list(range(len(train)))
        random.Random("gspo-holdout").shuffle(order)
        evals = [train[i] for i in sorted(order[:held])]
        keep = set(order[held:])
        train = [ex for i, ex in enumerate(train) if i in keep]
    return DatasetTask(train, evals, name=name if in_memory else Path(path).name, notes=notes)
